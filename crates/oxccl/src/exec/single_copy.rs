//! Single-copy transfers in the executor: where a link offers it ([`Link::single_copy`]:
//! shared memory, at least `LEND_MIN` bytes, the receiver may read the sender's memory), a
//! send lends its source range to the peer and completes once the peer has copied all of it,
//! and the matching receive copies the range straight out of the sender's memory, chunk by
//! chunk: into the destination for a store, through a cache-sized staging chunk for a
//! reduction. The bytes cross memory once (the receiver's copy) instead of twice (into the
//! link's ring and out again), and the sender spends nothing on them.
//!
//! The schedule does not change: a send still completes within its step, so its source stays
//! untouched until the receiver has read it (the schedule's validation keeps a step from
//! writing what its sends read), and a schedule that runs over rings no larger than its
//! messages runs the same way over loans (the simulator checks every algorithm so:
//! `sched::sim`, a send completes only once its message is taken).
//!
//! [`Link::single_copy`]: crate::transport::Link::single_copy

use super::{apply_recv, Mem, Runner, Span, XState};
use crate::base::error::Result;
use crate::direct::hugepages;
use crate::direct::shared_buffer::region_of;
use crate::sched::{Combine, Xfer};
use crate::transport::{Link, LinkError};

/// Bytes copied out of a lent message per pass: a reduction stages this much in cache, and
/// the step's other transfers (the network's, in hier) are served between chunks.
pub(super) const CHUNK: usize = 256 << 10;

/// Where a link may lend or borrow, registers the call's private buffers as the single-copy
/// collectives do ([`hugepages::register`]): the kernel's cross-memory copies walk the
/// lender's pages one by one, far fewer of them on huge pages. A buffer reused call after
/// call (a DDP bucket, `oxccl perf`'s) pays once.
pub(super) fn register(links: &[Option<Box<dyn Link>>], mem: &Mem) {
    let lends = links
        .iter()
        .flatten()
        .any(|l| l.single_copy(true, usize::MAX) || l.single_copy(false, usize::MAX));
    if lends {
        for span in [&mem.input, &mem.output] {
            if let Span::One(p, len) = *span {
                if region_of(p, len).is_none() {
                    hugepages::register(p, len);
                }
            }
        }
    }
}

impl Runner<'_, '_, '_> {
    /// One pass over a single-copy transfer `x`: the call header first (through the link, as
    /// for any transfer), then the loan. Returns whether it moved.
    pub(super) fn progress_single(&mut self, x: &Xfer, s: &mut XState) -> Result<bool> {
        let (peer, len) = (x.peer(), x.len());
        let (rank, call, seq) = (self.ctx.rank, self.ctx.call, self.ctx.seq);
        let print = self.ctx.guard.print;
        let Some(link) = self.ctx.links.get_mut(peer).and_then(|l| l.as_mut()) else {
            return Err(self.internal(format!("no link to rank {peer}")));
        };
        let link_err = |e: LinkError| e.into_error(rank, peer, call, seq);
        let mut moved = false;
        match *x {
            Xfer::Send { src, .. } => {
                if s.hdr.pending() {
                    moved = s.hdr.send_with(&mut **link, &[]).map_err(link_err)?.1;
                    if s.hdr.pending() {
                        return Ok(moved);
                    }
                }
                let p = self.mem.ptr(src).map_err(|m| self.internal(m))?;
                // SAFETY: in bounds (checked by `ptr`); nothing in this step writes a region
                // that a send reads (validated), and the step ends only after this loan does.
                let data = unsafe { std::slice::from_raw_parts(p, len) };
                let link = self.ctx.links[peer].as_mut().expect("checked above");
                if link.try_lend(data).map_err(link_err)? {
                    s.done = len;
                    moved = true;
                }
            }
            Xfer::Recv { dst, combine, .. } => {
                if s.hdr.pending() {
                    let mut fault = None;
                    let hdr = &mut s.hdr;
                    let k = link
                        .try_recv(&mut |data| hdr.take(data, print, &mut fault))
                        .map_err(link_err)?;
                    if let Some(f) = fault {
                        return Err(f.error(rank, peer, call, seq));
                    }
                    moved = k > 0;
                    if s.hdr.pending() {
                        return Ok(moved);
                    }
                }
                let d = self.mem.ptr(dst).map_err(|m| self.internal(m))?;
                let with = match combine {
                    Combine::Store => None,
                    Combine::Reduce { with } => {
                        Some(self.mem.ptr(with).map_err(|m| self.internal(m))?)
                    }
                };
                let k = CHUNK.min(len - s.done);
                if self.mem.stage.1 < k {
                    return Err(self.internal("no staging chunk for a single-copy receive".into()));
                }
                let link = self.ctx.links[peer].as_mut().expect("checked above");
                let copied = match with {
                    // SAFETY: `done + k <= len`, in bounds (checked by `ptr`); nothing else in
                    // this step touches the destination (validated).
                    None => link.try_copy_lent(len, s.done, unsafe {
                        std::slice::from_raw_parts_mut(d.add(s.done), k)
                    }),
                    Some(w) => {
                        // SAFETY: the staging chunk: at least `k` bytes (checked above) of
                        // scratch that no schedule buffer covers, used only here, by one
                        // transfer at a time.
                        let stage = unsafe { std::slice::from_raw_parts_mut(self.mem.stage.0, k) };
                        let got = link.try_copy_lent(len, s.done, stage).map_err(link_err)?;
                        if got {
                            // SAFETY: `done + k <= len`: within the destination and the
                            // operand (validated lengths, bounds checked by `ptr`).
                            unsafe {
                                apply_recv(self.ctx.dtype, self.ctx.op, d, Some(w), s.done, stage)
                            };
                        }
                        Ok(got)
                    }
                };
                if copied.map_err(link_err)? {
                    s.done += k;
                    moved = true;
                }
            }
        }
        Ok(moved)
    }
}
