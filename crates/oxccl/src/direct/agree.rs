//! The agreement before a call is planned: what every rank says about its buffers, where the
//! call's plan depends on it ([`crate::plan::call_plan::ask`]).
//!
//! Whether a rank's input and output lie in shared buffers is that rank's own fact. Each rank
//! publishes where they lie (or, for a one-shot call, its input where they do not) in the
//! call's first direct event, which also carries the call's header, and reads every peer's:
//! every rank then counts the same ranks as sharing, and plans alike. The event is the one
//! the call's executor goes on from ([`Agreed::event`]): single-copy maps the published
//! buffers, one-shot folds from the published inputs.

use crate::base::buffers::Buffers;
use crate::base::error::Result;
use crate::direct::exec::DirectCtx;
use crate::direct::hugepages;
use crate::direct::link::EventRecord;
use crate::direct::shared_buffer::{region_of, Region};
use crate::plan::call_plan::{Ask, Sharing};

/// What the ranks agreed, and the event that carried it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Agreed {
    /// The call's first event, published by every rank (its header checked).
    pub event: u64,
    /// This rank's [`regions`] (published, unless a one-shot agreement published its input).
    pub regions: [u64; 8],
    /// How many ranks share their buffers: the plan's input.
    pub sharing: Sharing,
}

/// Where this rank's input and output lie in shared buffers, as the words an agreement
/// publishes (a region's four words each, zero for a private buffer), and whether each
/// (input, output) does.
pub(crate) fn regions(bufs: &mut Buffers<'_>) -> ([u64; 8], [bool; 2]) {
    let (inp, in_len) = bufs.input_raw();
    let (outp, out_len) = bufs.output_raw();
    let mut regions = [0u64; 8];
    let mut shared = [false; 2];
    for (i, (p, l)) in [(inp, in_len), (outp.cast_const(), out_len)]
        .into_iter()
        .enumerate()
    {
        if let Some(r) = region_of(p, l) {
            regions[4 * i..4 * i + 4].copy_from_slice(&r.to_words());
            shared[i] = true;
        }
    }
    (regions, shared)
}

/// Rank `p`'s input and output regions as it published them with event `e1` (this rank,
/// `me`, published `mine`): `None` for a buffer that is not shared.
pub(crate) fn regions_of(
    cx: &DirectCtx<'_>,
    me: usize,
    p: usize,
    e1: u64,
    mine: [u64; 8],
) -> [Option<Region>; 2] {
    let mut w = mine;
    if p != me {
        bytemuck::bytes_of_mut(&mut w).copy_from_slice(cx.direct.peer_slot(p, e1, 64));
    }
    [0, 1].map(|i| Region::from_words(w[4 * i..4 * i + 4].try_into().expect("4 words")))
}

/// Publishes this rank's part of agreement `ask` as the call's first event, waits for every
/// peer's (checking their headers), and counts the ranks that share their buffers.
pub(crate) fn agree(cx: &mut DirectCtx<'_>, ask: Ask, bufs: &mut Buffers<'_>) -> Result<Agreed> {
    let n = cx.nranks;
    let me = cx.wait.id().rank;
    let (inp, in_len) = bufs.input_raw();
    let (outp, out_len) = bufs.output_raw();
    let (regions, [in_shared, out_shared]) = regions(bufs);
    let record = EventRecord::buffers(inp, in_len, outp, out_len);
    let sharing = match ask {
        Ask::SingleCopy | Ask::Mapped => {
            if ask == Ask::SingleCopy {
                for ((p, l), shared) in [(inp, in_len), (outp.cast_const(), out_len)]
                    .into_iter()
                    .zip([in_shared, out_shared])
                {
                    if !shared {
                        // Private: the peers' cross-memory copies walk its pages (huge
                        // ones, once registered).
                        hugepages::register(p, l);
                    }
                }
            }
            let e = cx.begin(bytemuck::bytes_of(&regions), record)?;
            // A rank shares when each of its buffers is shared or empty (a broadcast's or
            // reduce's non-root).
            let count = (0..n)
                .filter(|&p| {
                    let rec = cx.direct.peer_record(p, e);
                    [rec.input_len, rec.output_len]
                        .into_iter()
                        .zip(regions_of(cx, me, p, e, regions))
                        .all(|(len, region)| len == 0 || region.is_some())
                })
                .count();
            (e, count)
        }
        Ask::OneShot => {
            let shared = in_shared && out_shared;
            let e = if shared {
                cx.begin(bytemuck::bytes_of(&regions), record)?
            } else {
                // SAFETY: the input is valid for its length for the whole call (Buffers'
                // contract) and only read here.
                let input = unsafe { std::slice::from_raw_parts(inp, in_len) };
                cx.begin(input, EventRecord::default())?
            };
            // A rank that published its input left its record empty.
            let count = (0..n)
                .filter(|&p| {
                    if p == me {
                        shared
                    } else {
                        cx.direct.peer_record(p, e).input_len != 0
                    }
                })
                .count();
            (e, count)
        }
    };
    Ok(Agreed {
        event: sharing.0,
        regions,
        sharing: Sharing::of(sharing.1, n),
    })
}
