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
                        let got = link.try_copy_lent(len, s.done, stage);
                        if let Ok(true) = got {
                            // SAFETY: `done + k <= len`: within the destination and the
                            // operand (validated lengths, bounds checked by `ptr`).
                            unsafe {
                                apply_recv(self.ctx.dtype, self.ctx.op, d, Some(w), s.done, stage)
                            };
                        }
                        got
                    }
                };
                // (A withdrawn loan waits here for the lender's cause: `link_err`.)
                if copied.map_err(|e| self.link_err(peer, e))? {
                    s.done += k;
                    moved = true;
                }
            }
        }
        Ok(moved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::buffers::Buffers;
    use crate::base::dtype::DataType;
    use crate::base::error::Error;
    use crate::base::op::ReduceOp;
    use crate::base::param::Config;
    use crate::base::wait::Spin;
    use crate::bootstrap::local::LocalExchange;
    use crate::bootstrap::Exchange;
    use crate::exec::{execute, Ctx, FaultHooks};
    use crate::sched::{Buf, BufRange, Schedule};
    use std::time::Duration;

    /// Runs `sched` as `rank` over `links`, single-copy allowed, on `input` and `output`.
    fn run(
        rank: usize,
        links: &mut [Option<Box<dyn Link>>],
        sched: &Schedule,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        let mut ctx = Ctx {
            rank,
            links,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            nranks: 3,
            spin: Spin::new(1),
            timeout: Duration::from_secs(10),
            call: "all_reduce",
            seq: 4,
            single_copy: true,
            guard: FaultHooks::default(),
            messages: None,
        };
        execute(
            &mut ctx,
            sched,
            &mut Buffers::new(input, output),
            &mut Vec::new(),
        )
    }

    /// A rank whose call fails while it lends a message (rank 1: its send to rank 2 is lent,
    /// then its receive from rank 0 finds rank 0 gone) returns, and its caller reuses the
    /// memory at once. Rank 2, copying the loan only afterwards, must fail, naming rank 1,
    /// instead of returning the memory's new bytes as its result: by store and by reduction.
    #[test]
    fn a_loan_of_a_rank_whose_call_failed_is_refused_not_read() {
        const LEN: usize = 1 << 20;
        for reduce in [false, true] {
            let mut tag = [0u8; 8];
            getrandom::fill(&mut tag).unwrap();
            let tag = u64::from_le_bytes(tag);
            let pid = std::process::id();
            let ts: Vec<_> = LocalExchange::group(3)
                .into_iter()
                .map(|mut ex| {
                    std::thread::spawn(move || {
                        let rank = ex.rank();
                        let peers: Vec<(usize, u32)> =
                            (0..3).filter(|&p| p != rank).map(|p| (p, pid)).collect();
                        let cfg = Config::default();
                        let mut links: Vec<Option<Box<dyn Link>>> = (0..3).map(|_| None).collect();
                        for (p, l) in
                            crate::transport::shm::connect(&mut ex, &peers, tag, &cfg).unwrap()
                        {
                            // Wrapped as a communicator's links are (for the status agent).
                            links[p] = Some(crate::transport::counted::counted(l).0);
                        }
                        assert!(links[(rank + 1) % 3]
                            .as_ref()
                            .unwrap()
                            .single_copy(true, LEN));
                        ex.barrier().unwrap();
                        if rank == 0 {
                            drop(links);
                            for _ in 0..3 {
                                ex.barrier().unwrap();
                            }
                            return None;
                        }
                        ex.barrier().unwrap(); // rank 0 is gone
                        let out = if rank == 1 {
                            let mut sched = Schedule::new("test");
                            sched.push_xfers([
                                Xfer::Send {
                                    peer: 2,
                                    src: BufRange::new(Buf::Input, 0, LEN),
                                },
                                Xfer::Recv {
                                    peer: 0,
                                    dst: BufRange::new(Buf::Output, 0, 8),
                                    combine: Combine::Store,
                                },
                            ]);
                            let mut input = vec![0u8; LEN];
                            let res = run(1, &mut links, &sched, &input, &mut [0u8; 8]);
                            assert!(
                                matches!(res, Err(Error::PeerLost { peer: 0, .. })),
                                "{res:?}"
                            );
                            // The caller reuses its memory as soon as the call returned.
                            input.fill(0x41);
                            ex.barrier().unwrap(); // rank 2 may copy now
                            ex.barrier().unwrap(); // rank 2 is done with rank 1's memory
                            drop(input);
                            None
                        } else {
                            ex.barrier().unwrap();
                            let combine = if reduce {
                                Combine::Reduce {
                                    with: BufRange::new(Buf::Input, 0, LEN),
                                }
                            } else {
                                Combine::Store
                            };
                            let mut sched = Schedule::new("test");
                            sched.push_xfers([Xfer::Recv {
                                peer: 1,
                                dst: BufRange::new(Buf::Output, 0, LEN),
                                combine,
                            }]);
                            let mut output = vec![0u8; LEN];
                            let res = run(2, &mut links, &sched, &[0u8; LEN], &mut output);
                            ex.barrier().unwrap();
                            Some((res, output.contains(&0x41)))
                        };
                        drop(links);
                        out
                    })
                })
                .collect();
            let mut res: Vec<_> = ts.into_iter().map(|t| t.join().unwrap()).collect();
            let (res, read_reused) = res.pop().flatten().expect("rank 2's result");
            match res {
                Err(Error::Remote {
                    rank: 2,
                    origin: 1,
                    seq: 4,
                    ref msg,
                    ..
                }) => assert!(msg.contains("still lent"), "{msg}"),
                other => panic!(
                    "reduce {reduce}: expected rank 1 named (read its reused memory: \
                     {read_reused}), got {other:?}"
                ),
            }
        }
    }
}
