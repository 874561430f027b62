//! The executor: runs one rank's [`Schedule`] over its links.
//!
//! Within a step every transfer progresses at once: sends copy as much as the link takes,
//! receives consume what has arrived, storing or reducing it straight into the destination in
//! whole elements (a partial element is carried over). When no transfer can progress, the
//! executor spins for [`Config::spin`](crate::Config::spin) rounds
//! ([`Config::tcp_spin`](crate::Config::tcp_spin) while a transfer it waits on is a socket's), then
//! sleeps on the links' doorbells or sockets in slices, checking between slices the call's
//! deadline and that the peers it waits for are alive.

mod call;
mod messages;
pub(crate) mod p2p;
mod single_copy;

pub(crate) use call::Call;
pub(crate) use messages::Messages;

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use rustix::event::PollFlags;

pub(crate) use crate::base::buffers::Buffers;
use crate::base::dtype::DataType;
use crate::base::error::{Error, Result};
use crate::base::op::ReduceOp;
use crate::base::reduce;
use crate::base::wait::{CallId, Doorbell, Spin, Waiter, NAP, SLEEP_SLICE};
use crate::direct::exec::FAILURE_SETTLE;
use crate::fault::fingerprint::{CallPrint, HeaderFlags, HeaderState};
use crate::fault::health::Health;
use crate::sched::{Buf, BufRange, Combine, Local, Schedule, Step, Xfer};
use crate::transport::{Link, LinkError, WaitSource};

/// Everything the executor needs besides the schedule and the buffers.
pub(crate) struct Ctx<'a> {
    /// This rank.
    pub rank: usize,
    /// Links indexed by peer rank (`None` for this rank).
    pub links: &'a mut [Option<Box<dyn Link>>],
    /// Element type of the call.
    pub dtype: DataType,
    /// Reduction op of the call.
    pub op: ReduceOp,
    /// Number of ranks (for averages).
    pub nranks: usize,
    /// How to spin before sleeping.
    pub spin: Spin,
    /// How long the whole call may take.
    pub timeout: Duration,
    /// The call's name, for errors.
    pub call: &'static str,
    /// The call's sequence number, for errors.
    pub seq: u64,
    /// Whether large transfers may go single-copy where a link offers it
    /// ([`Link::single_copy`]): for collectives, whose peers run schedules too.
    pub single_copy: bool,
    /// Failure handling: fingerprints, health, step timing (all off by default).
    pub guard: FaultHooks<'a>,
    /// For a collective made of messages (gather, scatter, all_to_allv): each transfer is a
    /// message with its own header, told apart from the user's ([`messages`]); the call
    /// headers of [`FaultHooks::print`] are then not sent (the print only describes the call
    /// to the direct area's check).
    pub messages: Option<Messages<'a>>,
}

/// The executor's failure-handling hooks ([`crate::fault::fingerprint`], [`crate::fault::health`]).
#[derive(Default)]
pub(crate) struct FaultHooks<'a> {
    /// This call's fingerprint: a header goes before the first data to each peer, and each
    /// peer's header is checked before any of its data is used.
    pub print: Option<&'a CallPrint>,
    /// Checked before every sleep; wakes sleeps when the communicator fails.
    pub health: Option<&'a Health>,
    /// When set, receives the end time of each step (the timeline, `OXCCL_TRACE`).
    pub step_ends: Option<&'a mut Vec<Instant>>,
    /// The host's direct area, when the communicator has one: a peer that publishes an event
    /// there while this call waits for it over a link is in another call (a mismatch).
    pub direct: Option<&'a dyn crate::direct::link::Direct>,
    /// Call headers that a point-to-point receive from any source read off a peer's link
    /// before this call began ([`crate::exec::p2p`]): the start of this call's data from that peer.
    pub held: Option<&'a mut [Option<[u8; crate::fault::fingerprint::HEADER_BYTES]>]>,
}

/// Progress of one transfer.
#[derive(Clone, Copy, Default)]
struct XState {
    done: usize,
    carry: [u8; 8],
    carry_len: usize,
    /// The call header still to send or receive before the data.
    hdr: HeaderState,
    /// Whether the data goes single-copy ([`single_copy`]).
    single: bool,
}

/// One of a schedule's buffers in memory.
enum Span {
    /// One range of memory: address, length.
    One(*mut u8, usize),
    /// Parts, each its own memory (a collective made of messages: each block a buffer of its
    /// own): `(offset in the buffer, address, length)`, by offset. A region lies in one part.
    Parts(Vec<(usize, *mut u8, usize)>),
}

impl XState {
    /// Whether the transfer of `len` bytes still has its header or data to move (an empty
    /// transfer of a collective made of messages still has its header).
    fn pending(&self, len: usize) -> bool {
        self.done < len || self.hdr.pending()
    }
}

/// Resolved memory of a schedule's buffers.
struct Mem {
    input: Span,
    output: Span,
    scratch: (*mut u8, usize),
    /// The staging chunk of single-copy reductions (not a schedule buffer).
    stage: (*mut u8, usize),
}

impl Mem {
    fn ptr(&self, r: BufRange) -> Result<*mut u8, String> {
        let (base, len) = match (r.buf, &self.input, &self.output) {
            (Buf::Input, Span::One(p, n), _) | (Buf::Output, _, Span::One(p, n)) => (*p, *n),
            (Buf::Input, Span::Parts(parts), _) | (Buf::Output, _, Span::Parts(parts)) => {
                return part(parts, r)
            }
            (Buf::Scratch, ..) => self.scratch,
        };
        if r.off.checked_add(r.len).is_none_or(|end| end > len) {
            return Err(format!("region {r:?} outside its buffer of {len} bytes"));
        }
        // SAFETY: `off + len <= buffer length`, checked above.
        Ok(unsafe { base.add(r.off) })
    }
}

/// The address of region `r` of a buffer in `parts`: inside one part, or an error.
fn part(parts: &[(usize, *mut u8, usize)], r: BufRange) -> Result<*mut u8, String> {
    if r.len == 0 {
        return Ok(std::ptr::NonNull::<u8>::dangling().as_ptr());
    }
    let after = parts.partition_point(|&(off, _, _)| off <= r.off);
    parts[..after]
        .iter()
        .rev()
        .find(|&&(off, _, len)| r.off + r.len <= off + len)
        // SAFETY: `off <= r.off` and `r.off + r.len <= off + len`: inside the part.
        .map(|&(off, p, _)| unsafe { p.add(r.off - off) })
        .ok_or_else(|| format!("region {r:?} is not inside one part of its buffer"))
}

/// Runs `sched` to completion. `scratch` is grown to the schedule's need and reused across
/// calls.
pub(crate) fn execute(
    ctx: &mut Ctx<'_>,
    sched: &Schedule,
    bufs: &mut Buffers<'_>,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let (p, n) = bufs.input_raw();
    let (input, output) = (Span::One(p as *mut u8, n), {
        let (p, n) = bufs.output_raw();
        Span::One(p, n)
    });
    run(ctx, sched, input, output, scratch)
}

/// Runs `sched` (a collective made of messages) over buffers in parts: `input` and `output`
/// as `(offset in the buffer, memory)`, by offset, each region of the schedule inside one
/// part. The parts' memory is borrowed for the call: the sends' read, the receives' written.
pub(crate) fn execute_parts(
    ctx: &mut Ctx<'_>,
    sched: &Schedule,
    input: &[(usize, &[u8])],
    output: &mut [(usize, &mut [u8])],
    scratch: &mut Vec<u64>,
) -> Result<()> {
    let input = Span::Parts(
        input
            .iter()
            .map(|(off, b)| (*off, b.as_ptr() as *mut u8, b.len()))
            .collect(),
    );
    let output = Span::Parts(
        output
            .iter_mut()
            .map(|(off, b)| (*off, b.as_mut_ptr(), b.len()))
            .collect(),
    );
    run(ctx, sched, input, output, scratch)
}

fn run(
    ctx: &mut Ctx<'_>,
    sched: &Schedule,
    input: Span,
    output: Span,
    scratch: &mut Vec<u64>,
) -> Result<()> {
    // Past the schedule's scratch: the staging chunk of single-copy reductions.
    let stage = if ctx.single_copy {
        single_copy::CHUNK
    } else {
        0
    };
    let words = (sched.scratch_bytes + stage).div_ceil(8);
    if scratch.len() < words {
        *scratch = Vec::with_capacity(words);
        crate::direct::hugepages::advise_fresh(scratch.as_ptr().cast(), words * 8);
        scratch.resize(words, 0);
    }
    let mem = Mem {
        input,
        output,
        scratch: (scratch.as_mut_ptr() as *mut u8, sched.scratch_bytes),
        // SAFETY: `scratch` holds at least `scratch_bytes + stage` bytes (grown above).
        stage: (
            unsafe { (scratch.as_mut_ptr() as *mut u8).add(sched.scratch_bytes) },
            stage,
        ),
    };
    if ctx.single_copy {
        single_copy::register(ctx.links, &mem);
    }
    let headers = HeaderFlags::new(
        ctx.guard.print.is_some() && ctx.messages.is_none(),
        ctx.links.len(),
    );
    let id = CallId {
        rank: ctx.rank,
        call: ctx.call,
        seq: ctx.seq,
    };
    let mut run = Runner {
        wait: Waiter::new(id, ctx.spin, ctx.timeout, true),
        ctx,
        mem: &mem,
        headers,
        failed_seen: None,
        before: Vec::new(),
    };
    let res = run.steps(sched);
    if res.is_err() {
        // A send that lent its memory and never saw the loan end: the caller may reuse that
        // memory as soon as this returns, so the loan is withdrawn first.
        for link in run.ctx.links.iter_mut().flatten() {
            link.withdraw();
        }
    }
    res
}

struct Runner<'c, 'a, 'm> {
    ctx: &'c mut Ctx<'a>,
    mem: &'m Mem,
    /// The call's waiting: spin, sleep slices, deadline.
    wait: Waiter,
    /// Which peers got this call's header and sent theirs.
    headers: HeaderFlags,
    /// When this call first saw the communicator failed.
    failed_seen: Option<Instant>,
    /// Per transfer of the step, for a collective made of messages: what a receive reads
    /// before its own message.
    before: Vec<messages::Before>,
}

/// How long a call that sees the communicator failed elsewhere goes on taking data that is
/// already on its way (peers that finished this call before failing in a later one), so
/// that a correct call is not failed by a later call's error. An abort stops at once.
const FAIL_GRACE: Duration = Duration::from_millis(100);

impl Runner<'_, '_, '_> {
    fn internal(&self, msg: String) -> Error {
        Error::Aborted {
            rank: self.ctx.rank,
            msg: format!(
                "internal error in {} (call #{}): {msg}",
                self.ctx.call, self.ctx.seq
            ),
        }
    }

    fn steps(&mut self, sched: &Schedule) -> Result<()> {
        self.messages_begin()?;
        for step in &sched.steps {
            self.step(step)?;
            if let Some(ends) = self.ctx.guard.step_ends.as_deref_mut() {
                ends.push(Instant::now());
            }
        }
        Ok(())
    }

    /// The error of this call when its link to `peer` failed with `e`. A peer that withdrew
    /// its loan failed its call: its own cause (the watchdog brings it) is looked for up to
    /// [`FAILURE_SETTLE`] before the peer itself is named.
    fn link_err(&self, peer: usize, e: LinkError) -> Error {
        if let (LinkError::Withdrawn(_), Some(h)) = (&e, self.ctx.guard.health) {
            let until = Instant::now() + FAILURE_SETTLE;
            while Instant::now() < until {
                if h.is_failed() {
                    return h.error(self.ctx.rank, self.ctx.call, self.ctx.seq);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        e.into_error(self.ctx.rank, peer, self.ctx.call, self.ctx.seq)
    }

    fn local(&self, l: &Local) -> Result<()> {
        match *l {
            Local::Copy { src, dst } => {
                let s = self.mem.ptr(src).map_err(|m| self.internal(m))?;
                let d = self.mem.ptr(dst).map_err(|m| self.internal(m))?;
                if src.len != dst.len {
                    return Err(
                        self.internal(format!("copy of {} bytes into {}", src.len, dst.len))
                    );
                }
                if s != d {
                    // SAFETY: both ranges are in bounds (checked by `ptr`); `std::ptr::copy`
                    // allows overlap.
                    unsafe { std::ptr::copy(s, d, src.len) };
                }
            }
            Local::DivideByRanks(r) => {
                let p = self.mem.ptr(r).map_err(|m| self.internal(m))?;
                // SAFETY: in bounds (checked by `ptr`); no other reference to this memory is
                // live during local work.
                let buf = unsafe { std::slice::from_raw_parts_mut(p, r.len) };
                reduce::divide_by(self.ctx.dtype, buf, self.ctx.nranks);
            }
            Local::Reduce { dst, src } => {
                let d = self.mem.ptr(dst).map_err(|m| self.internal(m))?;
                let s = self.mem.ptr(src).map_err(|m| self.internal(m))?;
                if src.len != dst.len
                    || (s as usize) < d as usize + dst.len && (d as usize) < s as usize + src.len
                {
                    return Err(self.internal(format!("local reduce of {src:?} into {dst:?}")));
                }
                // SAFETY: both in bounds (checked by `ptr`) and disjoint (checked above); no
                // other reference to this memory is live during local work.
                let (dst_b, src_b) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(d, dst.len),
                        std::slice::from_raw_parts(s, src.len),
                    )
                };
                reduce::reduce_inplace(self.ctx.dtype, self.ctx.op, dst_b, src_b);
            }
        }
        Ok(())
    }

    fn step(&mut self, step: &Step) -> Result<()> {
        for l in &step.before {
            self.local(l)?;
        }
        let mut st = vec![XState::default(); step.xfers.len()];
        if self.ctx.single_copy {
            for (x, s) in step.xfers.iter().zip(st.iter_mut()) {
                s.single = self
                    .ctx
                    .links
                    .get(x.peer())
                    .and_then(|l| l.as_ref())
                    .is_some_and(|l| l.single_copy(matches!(x, Xfer::Send { .. }), x.len()));
            }
        }
        if self.ctx.messages.is_some() {
            self.messages_step(step, &mut st)?;
        } else if let Some(p) = self.ctx.guard.print {
            for (x, s) in step.xfers.iter().zip(st.iter_mut()) {
                s.hdr = self
                    .headers
                    .start(p, x.peer(), matches!(x, Xfer::Send { .. }));
                let held = match (x, self.ctx.guard.held.as_deref_mut()) {
                    (Xfer::Recv { .. }, Some(h)) if s.hdr.pending() => {
                        h.get_mut(x.peer()).and_then(|h| h.take())
                    }
                    _ => None,
                };
                if let Some(bytes) = held {
                    let mut fault = None;
                    s.hdr.take(&bytes, Some(p), &mut fault);
                    if let Some(f) = fault {
                        return Err(f.error(self.ctx.rank, x.peer(), self.ctx.call, self.ctx.seq));
                    }
                }
            }
        }
        // While a transfer of the step waits on a socket, a spin round costs a system call
        // per socket transfer and the data trickles in at the link's pace, resetting the
        // spin at every packet: spin only `tcp_spin` rounds, then sleep in poll(), so that a
        // slow link costs no CPU. That holds for steps that also carry shared-memory
        // transfers (hier's pipeline); once only those are left, the step spins as usual.
        let mut on_sockets = self.socket_pending(step, &st);
        self.wait.rearm_spinning(if on_sockets {
            self.ctx.spin.for_sockets()
        } else {
            self.ctx.spin
        });
        loop {
            let (progressed, done) = self.progress(step, &mut st)?;
            if done {
                break;
            }
            if on_sockets && !self.socket_pending(step, &st) {
                on_sockets = false;
                self.wait.rearm_spinning(self.ctx.spin);
            }
            if progressed {
                self.wait.progressed();
                continue;
            }
            if self.wait.spin() {
                continue;
            }
            if self.check_health()? {
                // Failed elsewhere, within the grace: keep taking what arrives.
                std::thread::sleep(NAP);
                self.wait.progressed();
                continue;
            }
            if self.sleep(step, &mut st)? {
                self.wait.progressed();
                continue;
            }
            self.check(step, &st)?;
        }
        for l in &step.after {
            self.local(l)?;
        }
        Ok(())
    }

    /// One pass over the step's pending transfers. Returns (made progress, all done).
    fn progress(&mut self, step: &Step, st: &mut [XState]) -> Result<(bool, bool)> {
        let mut progressed = false;
        let mut all_done = true;
        let es = self.ctx.dtype.size();
        let (dtype, op) = (self.ctx.dtype, self.ctx.op);
        for (i, (x, s)) in step.xfers.iter().zip(st.iter_mut()).enumerate() {
            let len = x.len();
            if !s.pending(len) {
                continue;
            }
            let peer = x.peer();
            if self.ctx.links.get(peer).and_then(|l| l.as_ref()).is_none() {
                return Err(self.internal(format!("no link to rank {peer}")));
            }
            match *x {
                _ if s.single => progressed |= self.progress_single(x, s)?,
                Xfer::Recv { .. } if s.hdr.pending() && self.ctx.messages.is_some() => {
                    progressed |= self.message_header(i, x, s)?
                }
                Xfer::Send { src, .. } => {
                    let p = self.mem.ptr(src).map_err(|m| self.internal(m))?;
                    // SAFETY: in bounds (checked by `ptr`); the schedule's validation ensures
                    // nothing in this step writes a region that a send reads.
                    let data = unsafe { std::slice::from_raw_parts(p.add(s.done), len - s.done) };
                    let link = self.ctx.links[peer].as_mut().expect("checked above");
                    let sent = if s.hdr.pending() {
                        s.hdr.send_with(&mut **link, data)
                    } else {
                        link.try_send(data).map(|k| (k, k > 0))
                    };
                    match sent {
                        Ok((k, moved)) => {
                            s.done += k;
                            progressed |= moved;
                        }
                        Err(e) => return Err(self.link_err(peer, e)),
                    }
                }
                Xfer::Recv {
                    dst,
                    combine: Combine::Store,
                    ..
                } if s.carry_len == 0 && !s.hdr.pending() => {
                    // (Only once the call's header from this peer has been taken and checked:
                    // the header precedes the data in the stream.)
                    // A plain store: let the link write into the destination directly.
                    let d = self.mem.ptr(dst).map_err(|m| self.internal(m))?;
                    // SAFETY: in bounds (checked by `ptr`); nothing else in this step touches
                    // the destination (validated).
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(d.add(s.done), len - s.done) };
                    let link = self.ctx.links[peer].as_mut().expect("checked above");
                    match link.try_recv_into(out) {
                        Ok(k) => {
                            s.done += k;
                            progressed |= k > 0;
                        }
                        Err(e) => return Err(self.link_err(peer, e)),
                    }
                }
                Xfer::Recv { dst, combine, .. } => {
                    let d = self.mem.ptr(dst).map_err(|m| self.internal(m))?;
                    let with = match combine {
                        Combine::Store => None,
                        Combine::Reduce { with } => {
                            Some(self.mem.ptr(with).map_err(|m| self.internal(m))?)
                        }
                    };
                    // SAFETY: `off + bytes.len() <= len` (the consumer never takes more than the
                    // transfer's remaining length).
                    let apply = |off: usize, bytes: &[u8]| unsafe {
                        apply_recv(dtype, op, d, with, off, bytes)
                    };
                    let print = self.ctx.guard.print;
                    let mut fault = None;
                    let mut consume = |data: &[u8]| {
                        let taken = s.hdr.take(data, print, &mut fault);
                        if s.hdr.pending() || fault.is_some() {
                            return taken;
                        }
                        taken + consume(s, len, es, &data[taken..], &apply)
                    };
                    let link = self.ctx.links[peer].as_mut().expect("checked above");
                    let res = link.try_recv(&mut consume);
                    if let Some(f) = fault {
                        return Err(f.error(self.ctx.rank, peer, self.ctx.call, self.ctx.seq));
                    }
                    match res {
                        Ok(k) => progressed |= k > 0,
                        Err(e) => return Err(self.link_err(peer, e)),
                    }
                }
            }
            if s.pending(len) {
                all_done = false;
            }
        }
        Ok((progressed, all_done))
    }

    /// Whether a transfer of `step` still pending waits on a socket.
    fn socket_pending(&self, step: &Step, st: &[XState]) -> bool {
        step.xfers.iter().zip(st).any(|(x, s)| {
            s.pending(x.len())
                && self
                    .ctx
                    .links
                    .get(x.peer())
                    .and_then(|l| l.as_ref())
                    .is_some_and(|l| match x {
                        Xfer::Send { .. } => matches!(l.send_wait(), WaitSource::Fd(_)),
                        Xfer::Recv { .. } => matches!(l.recv_wait(), WaitSource::Fd(_)),
                    })
        })
    }

    /// Sleeps until a pending link may progress or a slice passes. Returns true if the
    /// re-check made progress (no sleep happened).
    fn sleep(&mut self, step: &Step, st: &mut [XState]) -> Result<bool> {
        let mut bell: Option<*const Doorbell> = None;
        let mut fds: Vec<(RawFd, PollFlags)> = Vec::new();
        for (x, s) in step.xfers.iter().zip(st.iter()) {
            if !s.pending(x.len()) {
                continue;
            }
            let Some(link) = self.ctx.links.get(x.peer()).and_then(|l| l.as_ref()) else {
                continue;
            };
            let (src, flags) = match x {
                Xfer::Send { .. } => (link.send_wait(), PollFlags::OUT),
                Xfer::Recv { .. } => (link.recv_wait(), PollFlags::IN),
            };
            match src {
                WaitSource::Doorbell(b) => bell = Some(b as *const Doorbell),
                WaitSource::Fd(fd) => fds.push((fd.as_raw_fd(), flags)),
            }
        }
        if fds.is_empty() {
            let Some(bell) = bell else { return Ok(false) };
            // SAFETY: the doorbell lives in a link (or its shared segment) owned by
            // `ctx.links`, which outlives this call; links are not dropped during a step.
            let bell = unsafe { &*bell };
            // A failure (abort, the watchdog) rings this doorbell while it is registered.
            let _registered = self.ctx.guard.health.map(|h| h.sleeping_on(bell));
            let token = bell.prepare();
            if self.ctx.guard.health.is_some_and(|h| h.is_failed()) {
                bell.cancel(token);
                return Ok(false);
            }
            let (progressed, done) = match self.progress(step, st) {
                Ok(r) => r,
                Err(e) => {
                    bell.cancel(token);
                    return Err(e);
                }
            };
            if progressed || done {
                bell.cancel(token);
                return Ok(true);
            }
            bell.wait(token, SLEEP_SLICE);
            return Ok(false);
        }
        // Sockets (maybe mixed with a doorbell: then poll briefly and come back to spin).
        let timeout = if bell.is_some() { NAP } else { SLEEP_SLICE };
        if let Some(fd) = self.ctx.guard.health.and_then(|h| h.poll_fd()) {
            fds.push((fd.as_raw_fd(), PollFlags::IN));
        }
        // SAFETY: each fd belongs to a link in `ctx.links` (or to the health state), alive
        // for this call.
        match unsafe { crate::base::wait::poll_fds(&fds, timeout) } {
            Ok(()) => Ok(false),
            Err(e) => Err(Error::Io {
                rank: self.ctx.rank,
                context: "poll".into(),
                source: e.into(),
            }),
        }
    }

    /// The communicator failed (a peer lost, another rank's error, abort): stop, after
    /// [`FAIL_GRACE`] unless aborted. `Ok(true)`: failed, but within the grace.
    fn check_health(&mut self) -> Result<bool> {
        match self.ctx.guard.health {
            Some(h) if h.is_failed() => {
                let since = *self.failed_seen.get_or_insert_with(Instant::now);
                if h.is_aborted() || since.elapsed() >= FAIL_GRACE {
                    Err(h.error(self.ctx.rank, self.ctx.call, self.ctx.seq))
                } else {
                    Ok(true)
                }
            }
            _ => Ok(false),
        }
    }

    /// Between sleeps, once a slice has passed: the liveness of the peers still awaited, that
    /// none of them is in a direct-area call instead, and the deadline.
    fn check(&mut self, step: &Step, st: &[XState]) -> Result<()> {
        let Runner { ctx, wait, .. } = self;
        let id = wait.id();
        let pending = || {
            step.xfers
                .iter()
                .zip(st)
                .filter(|(x, s)| s.pending(x.len()))
                .map(|(x, _)| x.peer())
                .collect()
        };
        wait.check(pending, |pending| {
            for &peer in pending {
                if let Some(link) = ctx.links.get_mut(peer).and_then(|l| l.as_mut()) {
                    link.check_alive()
                        .map_err(|e| e.into_error(id.rank, peer, id.call, id.seq))?;
                }
            }
            if let (Some(d), Some(print)) = (ctx.guard.direct, ctx.guard.print) {
                let links = &mut ctx.links;
                if let Some(e) =
                    crate::direct::exec::direct_mismatch(d, pending, print, id.rank, id.seq, |p| {
                        unread(links, p)
                    })
                {
                    return Err(e);
                }
            }
            Ok(())
        })
    }
}

/// Whether bytes from `peer` wait unread on its link (peeked: nothing is taken).
pub(crate) fn unread(links: &mut [Option<Box<dyn Link>>], peer: usize) -> bool {
    let Some(link) = links.get_mut(peer).and_then(|l| l.as_mut()) else {
        return false;
    };
    let mut seen = false;
    let _ = link.try_recv(&mut |b: &[u8]| {
        seen |= !b.is_empty();
        0
    });
    seen
}

/// Stores `bytes` (whole elements) at `off` of a receive's destination `d`, or reduces them
/// there with the operand `with` (which may be `d` itself).
///
/// # Safety
/// `d` (and `with`) point to in-bounds destination (operand) ranges of at least
/// `off + bytes.len()` bytes; nothing else in the step writes the destination, and the
/// operand has the destination's length and is only read (the schedule's validation).
unsafe fn apply_recv(
    dtype: DataType,
    op: ReduceOp,
    d: *mut u8,
    with: Option<*mut u8>,
    off: usize,
    bytes: &[u8],
) {
    // SAFETY: the caller's contract.
    let out = unsafe { std::slice::from_raw_parts_mut(d.add(off), bytes.len()) };
    match with {
        None => out.copy_from_slice(bytes),
        Some(w) if w == d => reduce::reduce_inplace(dtype, op, out, bytes),
        Some(w) => {
            // SAFETY: the caller's contract.
            let a = unsafe { std::slice::from_raw_parts(w.add(off), bytes.len()) };
            reduce::reduce_into(dtype, op, out, a, bytes)
        }
    }
}

/// Takes bytes of a receive: completes a carried partial element, applies whole elements, and
/// carries a trailing partial one. Never takes more than the transfer still needs.
fn consume(
    s: &mut XState,
    len: usize,
    es: usize,
    data: &[u8],
    apply: &dyn Fn(usize, &[u8]),
) -> usize {
    let mut taken = 0;
    if s.carry_len > 0 {
        let k = (es - s.carry_len).min(data.len());
        s.carry[s.carry_len..s.carry_len + k].copy_from_slice(&data[..k]);
        s.carry_len += k;
        taken = k;
        if s.carry_len < es {
            return taken;
        }
        let elem = s.carry;
        apply(s.done, &elem[..es]);
        s.done += es;
        s.carry_len = 0;
    }
    let avail = (data.len() - taken).min(len - s.done);
    let whole = avail / es * es;
    if whole > 0 {
        apply(s.done, &data[taken..taken + whole]);
        s.done += whole;
        taken += whole;
    }
    let tail = avail - whole;
    if tail > 0 {
        s.carry[..tail].copy_from_slice(&data[taken..taken + tail]);
        s.carry_len = tail;
        taken += tail;
    }
    taken
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[test]
    fn consume_carries_partial_elements() {
        let out = RefCell::new(vec![0u8; 12]);
        let apply = |off: usize, b: &[u8]| out.borrow_mut()[off..off + b.len()].copy_from_slice(b);
        let mut s = XState::default();
        let data: Vec<u8> = (1..=12).collect();
        // Feed 3, 2, 6, 1 bytes, then more than needed.
        assert_eq!(consume(&mut s, 12, 4, &data[0..3], &apply), 3);
        assert_eq!(s.done, 0);
        assert_eq!(consume(&mut s, 12, 4, &data[3..5], &apply), 2);
        assert_eq!(s.done, 4);
        assert_eq!(consume(&mut s, 12, 4, &data[5..11], &apply), 6);
        assert_eq!(s.done, 8);
        let mut more = data[11..].to_vec();
        more.extend_from_slice(&[99, 99]);
        assert_eq!(
            consume(&mut s, 12, 4, &more, &apply),
            1,
            "must not take the next message's bytes"
        );
        assert_eq!(s.done, 12);
        assert_eq!(*out.borrow(), data);
    }
}

/// The between-sleeps check against a peer seen in the direct area, with the interleavings
/// forced: the peer acts (writes its link bytes, publishes its next call's first event) at
/// the moment this rank's check first looks at the direct area.
#[cfg(test)]
mod direct_race_tests {
    use super::*;
    use crate::base::dtype::DataType;
    use crate::base::op::ReduceOp;
    use crate::direct::link::{mem_group, Direct, EventRecord, MemDirect};
    use crate::fault::fingerprint::{Fingerprint, Header, HEADER_BYTES};
    use crate::sched::{Buf, BufRange, CollKind, Combine, Schedule, Xfer};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;

    /// What the peer does when this rank first asks whether it has reached an event.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum PeerAct {
        /// Writes the rest of its bytes for this call, then enters a direct-area call (the
        /// race d0a4434 fixed: it finished this call; this rank has not yet taken its bytes).
        FinishThenDirect,
        /// Enters a direct-area call without sending this call's bytes (a real mismatch).
        DirectInstead,
    }

    /// Rank 0's direct area, with the peer (rank 1) acting inside `reached`.
    struct HookDirect {
        mine: MemDirect,
        peer: Mutex<(MemDirect, Box<dyn Link>)>,
        act: PeerAct,
        bytes: Vec<u8>,
        fired: AtomicBool,
        barrier: [u8; HEADER_BYTES],
    }

    impl Direct for HookDirect {
        fn slot_bytes(&self) -> usize {
            self.mine.slot_bytes()
        }
        fn publish(&mut self, data: &[u8], record: &EventRecord) -> u64 {
            self.mine.publish(data, record)
        }
        fn reached(&self, peer: usize, e: u64) -> bool {
            if !self.fired.swap(true, Ordering::SeqCst) {
                let mut g = self.peer.lock().unwrap();
                let (d, link) = &mut *g;
                if self.act == PeerAct::FinishThenDirect {
                    // Its last bytes first (the link's release), then the event (the
                    // direct area's release), as the real executors do.
                    assert_eq!(link.try_send(&self.bytes).unwrap(), self.bytes.len());
                }
                let rec = EventRecord {
                    header: self.barrier,
                    ..Default::default()
                };
                d.publish(&[], &rec);
            }
            self.mine.reached(peer, e)
        }
        fn event(&self) -> u64 {
            self.mine.event()
        }
        fn peer_slot(&self, peer: usize, e: u64, len: usize) -> &[u8] {
            self.mine.peer_slot(peer, e, len)
        }
        fn peer_record(&self, peer: usize, e: u64) -> EventRecord {
            self.mine.peer_record(peer, e)
        }
        fn read_peer(&self, peer: usize, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
            self.mine.read_peer(peer, addr, dst)
        }
        fn write_peer(&self, peer: usize, addr: u64, src: &[u8]) -> std::io::Result<()> {
            self.mine.write_peer(peer, addr, src)
        }
        fn can_read_peers(&self) -> bool {
            true
        }
        fn doorbell(&self) -> &Doorbell {
            self.mine.doorbell()
        }
        fn check_alive(&self, peer: usize) -> Result<(), LinkError> {
            self.mine.check_alive(peer)
        }
        fn cadence(&mut self) -> &mut crate::base::wait::Cadence {
            self.mine.cadence()
        }
    }

    /// Rank 0 runs a link call (one receive of `n` u64 from rank 1, call #2) while rank 1
    /// acts as `act` once rank 0 has slept past a slice. Returns rank 0's result and output.
    fn run(act: PeerAct, n: usize) -> (Result<()>, Vec<u64>) {
        let mut links = crate::transport::mem::group(2, 1 << 20);
        let (_, peer_link) = links[1].pop().unwrap();
        let (_, my_link) = links[0].pop().unwrap();
        let mut my_links: Vec<Option<Box<dyn Link>>> = vec![None, Some(my_link)];
        let mut areas = mem_group(2);
        let peer_area = areas.pop().unwrap();
        let my_area = areas.pop().unwrap();
        let fp = |kind, count| Fingerprint::of(kind, DataType::U64, ReduceOp::Sum, count, 0);
        let print = CallPrint {
            fp: fp(CollKind::AllReduce, n),
            send_seq: 2,
            recv_seq: 2,
            call_seq: 2,
        };
        // What rank 1 sends: the call's header, then its data.
        let theirs = CallPrint {
            send_seq: 2,
            ..print
        };
        let mut bytes = theirs.header().to_vec();
        let data: Vec<u64> = (0..n as u64).map(|i| i * 3 + 1).collect();
        bytes.extend(data.iter().flat_map(|v| v.to_ne_bytes()));
        let barrier = Header {
            fp: fp(CollKind::Barrier, 0),
            mseq: 3,
        }
        .encode();
        let direct = HookDirect {
            mine: my_area,
            peer: Mutex::new((peer_area, peer_link)),
            act,
            bytes,
            fired: AtomicBool::new(false),
            barrier,
        };
        let mut sched = Schedule::new("test");
        let len = n * 8;
        sched.push_xfers([Xfer::Recv {
            peer: 1,
            dst: BufRange::new(Buf::Output, 0, len),
            combine: Combine::Store,
        }]);
        let mut ctx = Ctx {
            rank: 0,
            links: &mut my_links,
            dtype: DataType::U64,
            op: ReduceOp::Sum,
            nranks: 2,
            spin: Spin::new(1),
            timeout: Duration::from_secs(2),
            call: "all_reduce",
            seq: 2,
            single_copy: false,
            guard: FaultHooks {
                print: Some(&print),
                direct: Some(&direct),
                ..Default::default()
            },
            messages: None,
        };
        let mut out = vec![0u64; n];
        let res = {
            // SAFETY: u64 has no invalid bit patterns; the byte view covers `out` exactly.
            let out_b =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), len) };
            let mut bufs = Buffers::new(&[], out_b);
            execute(&mut ctx, &sched, &mut bufs, &mut Vec::new())
        };
        assert!(direct.fired.load(Ordering::SeqCst), "the check never ran");
        (res, out)
    }

    #[test]
    fn a_peer_that_finished_and_entered_a_direct_call_is_no_mismatch() {
        let (res, out) = run(PeerAct::FinishThenDirect, 1);
        res.expect("rank 1 finished this call before its barrier: not a mismatch");
        assert_eq!(out, vec![1]);
        let (res, out) = run(PeerAct::FinishThenDirect, 4096);
        res.expect("a larger last message");
        assert_eq!(out, (0..4096).map(|i| i * 3 + 1).collect::<Vec<u64>>());
    }

    #[test]
    fn a_peer_in_a_direct_call_instead_is_a_mismatch() {
        let (res, _) = run(PeerAct::DirectInstead, 1);
        match res {
            Err(Error::Mismatch {
                rank: 0,
                peer: 1,
                seq: 2,
                theirs,
                ..
            }) => {
                assert!(theirs.contains("barrier"), "{theirs}")
            }
            other => panic!("expected a mismatch naming rank 1's barrier, got {other:?}"),
        }
    }
}
