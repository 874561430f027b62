//! The blocking calls: the typed collectives and point-to-point calls, their argument
//! checks, and the path of one call (`run`: sequence number, algorithm choice, execution).

use std::sync::MutexGuard;

use tracing::debug;

use crate::base::dtype::{DataType, Element};
use crate::base::error::{Error, Result};
use crate::base::op::ReduceOp;
use crate::base::wait::CallId;
use crate::comm::{Communicator, State};
use crate::direct::link::Direct;
use crate::exec::p2p::{self, P2pOp};
use crate::exec::{self, Buffers};
use crate::fault::fingerprint::{CallPrint, Fingerprint, P2pCall};
use crate::plan::call_plan::{Facts, Plan, Planner, Sharing};
use crate::plan::tune;
use crate::sched::{Blocks, Coll, CollKind};
use crate::transport::tcp::lazy::LazyTcp;

/// One call's arguments, before buffers.
struct Call {
    kind: CollKind,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
}

impl Communicator {
    fn bad(&self, call: &'static str, seq: u64, msg: String) -> Error {
        Error::InvalidArgument {
            rank: self.rank,
            call,
            seq,
            msg,
        }
    }

    fn check_root(&self, call: &'static str, seq: u64, root: usize) -> Result<()> {
        if root >= self.nranks {
            return Err(self.bad(
                call,
                seq,
                format!("root {root} is out of range (world size {})", self.nranks),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, call: &'static str, seq: u64, peer: usize) -> Result<()> {
        if peer >= self.nranks {
            return Err(self.bad(
                call,
                seq,
                format!("peer {peer} is out of range (world size {})", self.nranks),
            ));
        }
        if peer == self.rank {
            return Err(self.bad(
                call,
                seq,
                format!("rank {peer} cannot {call} to or from itself"),
            ));
        }
        Ok(())
    }

    /// Runs one call: sequence number, validation (by `validate`, which sees the sequence
    /// number), algorithm choice, execution. A fatal error leaves the communicator unusable.
    fn run<'b>(
        &self,
        name: &'static str,
        validate: impl FnOnce(u64) -> Result<Call>,
        mut bufs: Buffers<'b>,
    ) -> Result<()> {
        let (mut st, seq) = self.begin_call(name)?;
        let call = validate(seq)?;
        // The topology joins the call only for schedules (below): the direct algorithms do not
        // use it, and cloning the Arc twice a call was a measurable part of an 8-byte call.
        let coll = Coll {
            kind: call.kind,
            rank: self.rank,
            nranks: self.nranks,
            count: call.count,
            dtype: call.dtype,
            op: call.op.kernel(),
            root: call.root,
            chunk_bytes: self.cfg.chunk_bytes,
            topo: None,
            blocks: None,
        };
        let situation = tune::Situation {
            kind: call.kind,
            input_bytes: Coll {
                rank: call.root,
                ..coll.clone()
            }
            .input_bytes(),
            direct: st.direct.is_some(),
            cma: st.direct.as_ref().is_some_and(|d| d.can_read_peers()),
            slot_bytes: st.direct.as_ref().map_or(0, |d| d.slot_bytes()),
            nranks: self.nranks,
            oneshot_max: self.cfg.oneshot_max,
            cma_min: self.cfg.cma_min,
            mapped_min: self.cfg.mapped_min,
            deterministic: self.cfg.deterministic,
        };
        // The call's plan: final here unless it depends on the ranks' buffers, which they
        // agree on in the call's first direct event (exec::Call::collective), and then what
        // runs unless every rank shares (what the flight recorder shows until the call ends).
        let planner = Planner {
            model: &self.model,
            topo: self.topo.as_deref(),
            facts: Facts {
                situation,
                forced: self.forced_algo,
                oneshot_mapped_min: self.cfg.oneshot_mapped_min,
            },
        };
        let first = planner.plan(Sharing::NotAsked);
        debug!(seq, call = name, count = call.count, dtype = %call.dtype, plan = ?first, "call");
        let fp = Fingerprint::of(call.kind, call.dtype, call.op, call.count, call.root);
        let print = st.seqr.next(self.rank, seq, call.kind, fp);
        let mut timing = self.guard.begin(seq, name, &print, first.name());
        let State {
            links,
            scratch,
            direct,
            stash,
            lazy,
            ..
        } = &mut *st;
        let res = exec::Call {
            id: CallId {
                rank: self.rank,
                call: name,
                seq,
            },
            nranks: self.nranks,
            spin: self.spin,
            timeout: self.guard.timeout(),
            print: &print,
            health: self.guard.health(),
            step_ends: timing.as_mut().map(|t| &mut t.1),
            links,
            direct: direct.as_deref_mut(),
            scratch,
            held: stash.held_mut(),
            nt_bytes: self.cfg.nt_bytes,
            lazy: lazy.as_mut(),
        }
        .collective(&planner, first, coll, self.topo.as_ref(), &mut bufs);
        Self::drop_made(lazy);
        // The plan that ran (perf's algo column, the flight recorder, the timeline).
        let ran = res.as_ref().map_or(first, |p| *p);
        st.last_algo = ran.name();
        let res = self
            .guard
            .end(seq, name, &print, ran.name(), timing, res.map(|_| ()));
        Self::end_call(&mut st, res)
    }

    /// A call's start: the check that this process made the communicator, its turn after
    /// queued calls, its sequence number, and the checks that the communicator still works.
    fn begin_call(&self, name: &'static str) -> Result<(MutexGuard<'_, State>, u64)> {
        self.own_process(name)?;
        self.stream.wait_turn(); // after the calls queued before this one (crate::comm::nonblocking)
        let mut st = self.lock();
        st.seq += 1;
        let seq = st.seq;
        if let Some(why) = &st.broken {
            return Err(Error::Aborted {
                rank: self.rank,
                msg: format!("{name} (call #{seq}) after an earlier failure: {why}"),
            });
        }
        if let Err(e) = self.guard.check(name, seq) {
            // A peer was lost before this call began: this call fails as the one that
            // noticed it, and every later one is Aborted (as after a failure inside a call).
            st.broken = Some(e.to_string());
            return Err(e);
        }
        Ok((st, seq))
    }

    /// Forgets the lazy TCP state once every link is made (closing its listener: no peer
    /// dials any more).
    /// Makes the links of `lazy` that `ops` need now, into `links`, within the call's timeout;
    /// returns what is left of the timeout.
    fn connect_lazy(
        &self,
        lazy: &mut Option<LazyTcp>,
        links: &mut [Option<Box<dyn crate::transport::Link>>],
        ops: &[P2pOp<'_>],
        name: &'static str,
        seq: u64,
    ) -> Result<std::time::Duration> {
        let timeout = self.guard.timeout();
        let Some(l) = lazy.as_mut() else {
            return Ok(timeout);
        };
        let t0 = std::time::Instant::now();
        for (p, link) in self.connect_p2p(l, ops, t0 + timeout, name, seq)? {
            links[p] = Some(link);
        }
        Self::drop_made(lazy);
        Ok(timeout.saturating_sub(t0.elapsed()))
    }

    fn drop_made(lazy: &mut Option<LazyTcp>) {
        if lazy.as_ref().is_some_and(|l| l.all_made()) {
            *lazy = None;
        }
    }

    /// Makes the TCP links a point-to-point group needs that are not made yet
    /// (`OXCCL_TCP_CONNECT=lazy`): those to the peers it names. A receive from any source
    /// reads from every rank, so it makes every TCP link this rank lacks: it dials each peer
    /// without one, in turn (each peer's acceptor answers whatever that peer is doing, so
    /// this waits for no peer's call).
    fn connect_p2p(
        &self,
        lazy: &mut LazyTcp,
        ops: &[P2pOp<'_>],
        deadline: std::time::Instant,
        name: &'static str,
        seq: u64,
    ) -> Result<Vec<(usize, Box<dyn crate::transport::Link>)>> {
        let any = ops
            .iter()
            .any(|op| matches!(op, P2pOp::Recv { peer: None, .. }));
        let named = ops.iter().filter_map(|op| match op {
            P2pOp::Send { peer, .. } => Some(*peer),
            P2pOp::Recv { peer, .. } => *peer,
        });
        let need = if any {
            lazy.missing(lazy.peers())
        } else {
            lazy.missing(named)
        };
        if need.is_empty() {
            return Ok(Vec::new());
        }
        let health = self.guard.health();
        let stop = || {
            health
                .is_failed()
                .then(|| health.error(self.rank, name, seq))
        };
        lazy.connect(&need, deadline, &stop, name, seq)
    }

    /// A call's end: a fatal error leaves the communicator unusable.
    fn end_call(st: &mut State, res: Result<()>) -> Result<()> {
        if let Err(e) = &res {
            if e.is_fatal() {
                st.broken = Some(e.to_string());
            }
        }
        res
    }

    /// Runs a group of the user's sends and receives ([`crate::exec::p2p`]) as one call.
    fn run_p2p(
        &self,
        name: &'static str,
        validate: impl FnOnce(u64) -> Result<Call>,
        ops: &mut [P2pOp<'_>],
    ) -> Result<()> {
        let (mut st, seq) = self.begin_call(name)?;
        let call = validate(seq)?;
        let print = CallPrint {
            fp: Fingerprint::of(call.kind, call.dtype, call.op, call.count, call.root),
            send_seq: 0,
            recv_seq: 0,
            call_seq: seq,
        };
        st.last_algo = "p2p";
        let timing = self.guard.begin(seq, name, &print, "p2p");
        let State {
            links,
            seqr,
            stash,
            direct,
            lazy,
            ..
        } = &mut *st;
        let timeout = match self.connect_lazy(lazy, links, ops, name, seq) {
            Ok(left) => left,
            Err(e) => {
                let res = self.guard.end(seq, name, &print, "p2p", timing, Err(e));
                return Self::end_call(&mut st, res);
            }
        };
        let res = p2p::Ctx {
            direct: direct.as_deref().map(|d| (d as &dyn Direct, print)),
            rank: self.rank,
            links,
            seqr,
            stash,
            stash_limit: self.cfg.p2p_stash_bytes,
            spin: self.spin,
            timeout,
            health: Some(self.guard.health()),
            call: name,
            seq,
        }
        .run(ops);
        let res = self.guard.end(seq, name, &print, "p2p", timing, res);
        Self::end_call(&mut st, res)
    }

    /// Runs sends and receives together, as NCCL's `ncclGroupStart`/`ncclGroupEnd` around
    /// `ncclSend`/`ncclRecv`: all progress at once, so any mix completes at any size (two
    /// ranks that both send first included), and the call returns when every send has been
    /// taken by its link and every receive filled. Any rank may be in a group with any
    /// others; ranks not in it need not call. Sends to one peer arrive in order; a receive
    /// takes the first message of its source and tag (see `exec/p2p.rs`); a receive with
    /// `peer: None` takes one from any rank and records it in `from`. Sends and receives to
    /// and from this rank itself are matched with each other.
    pub fn group_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        self.run_group(P2pCall::User, ops)
    }

    /// A collective made of sends and receives (`call`: a gather, a scatter, an all_to_all
    /// with blocks of different sizes): its sends and receives all progress at once, as
    /// [`group_p2p`](Self::group_p2p)'s do (tag 0, named peers only), with two differences
    /// that keep its messages apart from every other call's. It is a collective: every rank of the communicator calls it, in
    /// the same order as its other collectives, and its messages carry its number on the
    /// communicator's count of collectives; a receive of any other call never takes them,
    /// and its receives take nothing else (a user message read meanwhile is kept for a
    /// later receive; a message of another collective is an [`Error::Mismatch`]). And no
    /// rank gets ahead of a peer that has not begun it: each pair of ranks that exchanges a
    /// message in one direction only also exchanges an empty one in the other (the gather's
    /// root tells each rank it has begun, each rank tells a scatter's root), so a call
    /// refused on one rank (bad arguments there only) leaves its peers waiting in it, bounded
    /// by the timeout, until that rank calls it again, instead of letting them run on into
    /// later calls whose messages a later call of that rank would take.
    ///
    /// Such a call runs as a schedule ([`Algo::Flat`](crate::Algo::Flat), named `flat` by
    /// [`last_algo`](Self::last_algo), the flight recorder and `oxccl perf`), like every
    /// collective: its operations are its blocks (each send a block of its input, each
    /// receive one of its output), all of one element type; a rank's sends to itself are
    /// copied into its receives from itself, in order. With `call` [`P2pCall::User`] it is
    /// [`group_p2p`](Self::group_p2p).
    pub fn group_p2p_as(&self, call: P2pCall, ops: &mut [P2pOp<'_>]) -> Result<()> {
        if call.is_collective() {
            self.run_blocks(call, ops, |_| Ok(()))
        } else {
            self.run_group(call, ops)
        }
    }

    /// Gather, scatter and all_to_allv with blocks of one size, as `call_bytes` passes them
    /// (`count` elements a block, as all_gather's; the root's whole buffer, or every rank's
    /// for all_to_allv, holds `n` blocks in rank order): their operations, then
    /// [`run_blocks`](Self::run_blocks) after `validate`. In place, the root's own block of
    /// a gather or scatter stays where it is, and an all_to_allv sends from a copy of the
    /// buffer. Buffers that `validate` refuses give no operations.
    fn blocks_call(
        &self,
        kind: CollKind,
        dtype: DataType,
        root: usize,
        bufs: ByteBufs<'_>,
        validate: impl FnOnce(u64) -> Result<()>,
    ) -> Result<()> {
        let (n, me, es) = (self.nranks, self.rank, dtype.size());
        let send = |peer, buf| P2pOp::Send {
            peer,
            tag: 0,
            dtype,
            buf,
        };
        let recv = |peer, buf| P2pOp::Recv {
            peer: Some(peer),
            tag: 0,
            dtype,
            buf,
            from: None,
        };
        let copy: Vec<u64>;
        let mut ops: Vec<P2pOp<'_>> = Vec::new();
        let is_root = me == root && root < n;
        let call = match kind {
            CollKind::Gather => P2pCall::Gather,
            CollKind::Scatter => P2pCall::Scatter,
            _ => P2pCall::AllToAllV,
        };
        match (kind, bufs) {
            (CollKind::Gather, ByteBufs::Separate { send: s, recv: r }) => {
                if is_root && r.len() == n * s.len() {
                    ops.push(send(me, s));
                    ops.extend(
                        split_mut(r, n)
                            .into_iter()
                            .enumerate()
                            .map(|(p, b)| recv(p, b)),
                    );
                } else if !is_root && root < n {
                    ops.push(send(root, s));
                }
            }
            (CollKind::Gather, ByteBufs::InPlace(buf)) => {
                if is_root && buf.len() % n == 0 {
                    let blocks = split_mut(buf, n).into_iter().enumerate();
                    ops.extend(blocks.filter(|(p, _)| *p != me).map(|(p, b)| recv(p, b)));
                } else if !is_root && root < n {
                    ops.push(send(root, buf));
                }
            }
            (CollKind::Scatter, ByteBufs::Separate { send: s, recv: r }) => {
                if is_root && s.len() == n * r.len() {
                    ops.extend(split(s, n).into_iter().enumerate().map(|(p, b)| send(p, b)));
                    ops.push(recv(me, r));
                } else if !is_root && root < n {
                    ops.push(recv(root, r));
                }
            }
            (CollKind::Scatter, ByteBufs::InPlace(buf)) => {
                if is_root && buf.len() % n == 0 {
                    let blocks = split(buf, n).into_iter().enumerate();
                    ops.extend(blocks.filter(|(p, _)| *p != me).map(|(p, b)| send(p, b)));
                } else if !is_root && root < n {
                    ops.push(recv(root, buf));
                }
            }
            (_, ByteBufs::Separate { send: s, recv: r }) => {
                if s.len() == r.len() && s.len() % (n * es) == 0 {
                    ops.extend(split(s, n).into_iter().enumerate().map(|(p, b)| send(p, b)));
                    ops.extend(
                        split_mut(r, n)
                            .into_iter()
                            .enumerate()
                            .map(|(p, b)| recv(p, b)),
                    );
                }
            }
            (_, ByteBufs::InPlace(buf)) => {
                if buf.len() % (n * es) == 0 {
                    let mut words = vec![0u64; buf.len().div_ceil(8)];
                    bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..buf.len()]
                        .copy_from_slice(buf);
                    copy = words;
                    let s = &bytemuck::cast_slice::<u64, u8>(&copy)[..buf.len()];
                    ops.extend(split(s, n).into_iter().enumerate().map(|(p, b)| send(p, b)));
                    ops.extend(
                        split_mut(buf, n)
                            .into_iter()
                            .enumerate()
                            .map(|(p, b)| recv(p, b)),
                    );
                }
            }
        }
        self.run_blocks(call, &mut ops, validate)
    }

    /// The argument checks of a collective made of messages (`call`), before anything moves:
    /// named peers in range, whole elements of one type, no tags, sends to this rank itself
    /// matched by receives from itself of the same length. Returns the element type.
    fn check_blocks(&self, call: P2pCall, seq: u64, ops: &[P2pOp<'_>]) -> Result<DataType> {
        let (n, me, name) = (self.nranks, self.rank, call.name());
        let bad = |msg: String| self.bad(name, seq, msg);
        let dtype = ops.first().map_or(DataType::U8, |op| match op {
            P2pOp::Send { dtype, .. } | P2pOp::Recv { dtype, .. } => *dtype,
        });
        let (mut to_me, mut from_me) = (Vec::new(), Vec::new());
        for op in ops {
            let (peer, tag, dt, len) = match op {
                P2pOp::Send {
                    peer,
                    tag,
                    dtype,
                    buf,
                } => (Some(*peer), *tag, *dtype, buf.len()),
                P2pOp::Recv {
                    peer,
                    tag,
                    dtype,
                    buf,
                    ..
                } => (*peer, *tag, *dtype, buf.len()),
            };
            if let Some(p) = peer.filter(|&p| p >= n) {
                return Err(bad(format!("peer {p} is out of range (world size {n})")));
            }
            if len % dt.size() != 0 {
                return Err(bad(format!(
                    "a buffer of {len} bytes is not a whole number of {dt} elements"
                )));
            }
            if peer.is_none() {
                return Err(bad(format!(
                    "a {name} receives from named ranks only, not from any rank"
                )));
            }
            if tag != 0 {
                return Err(bad(format!("a {name} has no tags (got tag {tag})")));
            }
            if dt != dtype {
                return Err(bad(format!(
                    "a {name}'s buffers are all of one element type (got {dtype} and {dt})"
                )));
            }
            match op {
                P2pOp::Send { peer, .. } if *peer == me => to_me.push(len),
                P2pOp::Recv { peer: Some(p), .. } if *p == me => from_me.push(len),
                _ => {}
            }
        }
        for (k, &len) in to_me.iter().enumerate() {
            let Some(&got) = from_me.get(k) else {
                return Err(bad(
                    "a send to this rank itself (tag 0) needs a receive from itself in the same group"
                        .into(),
                ));
            };
            if got != len {
                return Err(bad(format!(
                    "a send to itself of {} x {dtype} into a receive of {} x {dtype}",
                    len / dtype.size(),
                    got / dtype.size()
                )));
            }
        }
        if from_me.len() > to_me.len() {
            return Err(bad(
                "a receive from this rank itself needs a send to itself in the same group".into(),
            ));
        }
        Ok(dtype)
    }

    /// Runs a collective made of messages (gather, scatter, all_to_allv) as its schedule
    /// (`sched::blocks`), over the buffers of its operations, with the executor's message
    /// framing (`exec::messages`).
    /// `check` runs first, with the call's sequence number.
    fn run_blocks(
        &self,
        call: P2pCall,
        ops: &mut [P2pOp<'_>],
        check: impl FnOnce(u64) -> Result<()>,
    ) -> Result<()> {
        let name = call.name();
        let (mut st, seq) = self.begin_call(name)?;
        check(seq)?;
        let dtype = self.check_blocks(call, seq, ops)?;
        let (n, me) = (self.nranks, self.rank);
        let kind = match call {
            P2pCall::Gather => CollKind::Gather,
            P2pCall::Scatter => CollKind::Scatter,
            P2pCall::AllToAllV | P2pCall::User => CollKind::AllToAllV,
        };
        let mut blocks = Blocks::new(n);
        let (mut in_off, mut out_off) = (0, 0);
        for op in ops.iter() {
            match op {
                P2pOp::Send { peer, buf, .. } => {
                    blocks.send[*peer].push((in_off, buf.len()));
                    in_off += buf.len();
                }
                P2pOp::Recv { peer, buf, .. } => {
                    let p = peer.unwrap_or(me); // named: checked above
                    blocks.recv[p].push((out_off, buf.len()));
                    out_off += buf.len();
                }
            }
        }
        let count = ops.first().map_or(0, |op| match op {
            P2pOp::Send { buf, .. } => buf.len(),
            P2pOp::Recv { buf, .. } => buf.len(),
        }) / dtype.size();
        let coll = Coll {
            kind,
            rank: me,
            nranks: n,
            count,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
            chunk_bytes: self.cfg.chunk_bytes,
            topo: None,
            blocks: Some(std::sync::Arc::new(blocks)),
        };
        let planner = Planner {
            model: &self.model,
            topo: self.topo.as_deref(),
            facts: Facts {
                situation: tune::Situation {
                    kind,
                    input_bytes: coll.input_bytes(),
                    direct: st.direct.is_some(),
                    cma: st.direct.as_ref().is_some_and(|d| d.can_read_peers()),
                    slot_bytes: st.direct.as_ref().map_or(0, |d| d.slot_bytes()),
                    nranks: n,
                    oneshot_max: self.cfg.oneshot_max,
                    cma_min: self.cfg.cma_min,
                    mapped_min: self.cfg.mapped_min,
                    deterministic: self.cfg.deterministic,
                },
                forced: self.forced_algo,
                oneshot_mapped_min: self.cfg.oneshot_mapped_min,
            },
        };
        let Plan::Schedule(algo) = planner.plan(Sharing::NotAsked) else {
            return Err(Error::Aborted {
                rank: me,
                msg: format!("internal error in {name} (call #{seq}): planned off a schedule"),
            });
        };
        let sched = algo.schedule(&coll);
        debug_assert!(sched.validate(me).is_ok(), "{:?}", sched.validate(me));
        // What the flight recorder shows, as for a group (the first operation's message).
        let first = match ops.first() {
            Some(P2pOp::Recv { peer, .. }) => CollKind::Recv {
                peer: peer.unwrap_or(me),
            },
            Some(P2pOp::Send { peer, .. }) => CollKind::Send { peer: *peer },
            None => CollKind::Send { peer: 0 },
        };
        let print = CallPrint {
            fp: Fingerprint::of(first, dtype, ReduceOp::Sum, count, 0),
            send_seq: 0,
            recv_seq: 0,
            call_seq: seq,
        };
        st.last_algo = algo.name();
        let mut timing = self.guard.begin(seq, name, &print, algo.name());
        let State {
            links,
            seqr,
            stash,
            direct,
            lazy,
            scratch,
            ..
        } = &mut *st;
        let timeout = match self.connect_lazy(lazy, links, ops, name, seq) {
            Ok(left) => left,
            Err(e) => {
                let res = self
                    .guard
                    .end(seq, name, &print, algo.name(), timing, Err(e));
                return Self::end_call(&mut st, res);
            }
        };
        // Numbered once accepted: a call refused above takes no number, as a refused
        // collective (its retry is the same collective).
        let coll_seq = seqr.next_coll();
        // How the direct area's check describes this call: a message of it.
        let dprint = CallPrint {
            fp: Fingerprint::p2p(dtype, count, false, call),
            send_seq: coll_seq,
            recv_seq: coll_seq,
            call_seq: seq,
        };
        let res = {
            let mut input: Vec<(usize, &[u8])> = Vec::new();
            let mut output: Vec<(usize, &mut [u8])> = Vec::new();
            let (mut in_off, mut out_off) = (0, 0);
            for op in ops.iter_mut() {
                match op {
                    P2pOp::Send { buf, .. } => {
                        input.push((in_off, *buf));
                        in_off += buf.len();
                    }
                    P2pOp::Recv { buf, .. } => {
                        let len = buf.len();
                        output.push((out_off, &mut **buf));
                        out_off += len;
                    }
                }
            }
            let mut ctx = exec::Ctx {
                rank: me,
                links,
                dtype,
                op: ReduceOp::Sum,
                nranks: n,
                spin: self.spin,
                timeout,
                call: name,
                seq,
                // A peer's user receive may read these messages: copied, never lent.
                single_copy: false,
                guard: exec::FaultHooks {
                    print: Some(&dprint),
                    health: Some(self.guard.health()),
                    step_ends: timing.as_mut().map(|t| &mut t.1),
                    direct: direct.as_deref().map(|d| d as &dyn Direct),
                    held: None,
                },
                messages: Some(exec::Messages {
                    call,
                    coll_seq,
                    seqr,
                    stash,
                    stash_limit: self.cfg.p2p_stash_bytes,
                }),
            };
            exec::execute_parts(&mut ctx, &sched, &input, &mut output, scratch)
        };
        if res.is_ok() {
            for op in ops.iter_mut() {
                if let P2pOp::Recv { peer, from, .. } = op {
                    *from = *peer;
                }
            }
        }
        let res = self.guard.end(seq, name, &print, algo.name(), timing, res);
        Self::end_call(&mut st, res)
    }

    fn run_group(&self, call: P2pCall, ops: &mut [P2pOp<'_>]) -> Result<()> {
        let first = ops.first().map(|op| match op {
            P2pOp::Send {
                peer, dtype, buf, ..
            } => (CollKind::Send { peer: *peer }, *dtype, buf.len()),
            P2pOp::Recv {
                peer, dtype, buf, ..
            } => (
                CollKind::Recv {
                    peer: peer.unwrap_or(self.rank),
                },
                *dtype,
                buf.len(),
            ),
        });
        let (kind, dtype, len) = first.unwrap_or((CollKind::Send { peer: 0 }, DataType::U8, 0));
        let validate = |_seq| {
            Ok(Call {
                kind,
                count: len / dtype.size(),
                dtype,
                op: ReduceOp::Sum,
                root: 0,
            })
        };
        self.run_p2p(call.name(), validate, ops)
    }

    /// Sends `buf` to `peer` with `tag`; the peer receives it with [`recv_tagged`](Self::recv_tagged)
    /// (Self::recv_tagged) (or [`recv_any`](Self::recv_any)) naming the same tag, in any
    /// order relative to its other tags. Tag 0 is [`send`](Self::send)'s.
    pub fn send_tagged<T: Element>(&self, buf: &[T], peer: usize, tag: u32) -> Result<()> {
        self.group_p2p(&mut [P2pOp::Send {
            peer,
            tag,
            dtype: T::DTYPE,
            buf: bytemuck::cast_slice(buf),
        }])
    }

    /// Receives `buf.len()` elements sent by `peer` with `tag`: the first such message,
    /// whether or not messages with other tags came before it (those are kept for later
    /// receives, up to [`Config::p2p_stash_bytes`](crate::Config::p2p_stash_bytes)).
    pub fn recv_tagged<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        self.group_p2p(&mut [P2pOp::Recv {
            peer: Some(peer),
            tag,
            dtype: T::DTYPE,
            buf: bytemuck::cast_slice_mut(buf),
            from: None,
        }])
    }

    /// Receives `buf.len()` elements sent with `tag` by any other rank (gloo's
    /// `recvFromAny`) and returns that rank. The message must have `buf`'s length and type.
    /// While it waits, this rank reads the next message of every peer (keeping the others
    /// for later receives): no peer may begin a collective with this rank meanwhile.
    pub fn recv_any<T: Element>(&self, buf: &mut [T], tag: u32) -> Result<usize> {
        let mut ops = [P2pOp::Recv {
            peer: None,
            tag,
            dtype: T::DTYPE,
            buf: bytemuck::cast_slice_mut(buf),
            from: None,
        }];
        self.group_p2p(&mut ops)?;
        match ops[0] {
            P2pOp::Recv { from: Some(f), .. } => Ok(f),
            _ => Err(Error::Aborted {
                rank: self.rank,
                msg: "internal error in recv_any: completed without a source".into(),
            }),
        }
    }

    /// The byte-level entry behind every collective: `kind` on buffers of `dtype` elements,
    /// for callers that know the type only at run time (the benchmark, the Python package).
    /// Lengths are in bytes and must be multiples of the element size, and the buffers aligned
    /// for it; what each buffer holds follows the typed methods ([`all_reduce`](Self::all_reduce)
    /// and friends, and their `_in_place` forms). [`CollKind::Gather`], [`CollKind::Scatter`]
    /// and [`CollKind::AllToAllV`] take blocks of one size here (blocks of different sizes:
    /// [`group_p2p_as`](Self::group_p2p_as)): a gather's root receives `n` blocks, each rank's
    /// send, in rank order (other ranks' receive buffers are ignored); a scatter's root sends
    /// `n` blocks, block `r` into rank `r`'s receive buffer (other ranks' send buffers are
    /// ignored); all_to_allv is all_to_all's shape. In place, the root's buffer holds the `n`
    /// blocks (its own at its rank's place) and every other rank's is its one block.
    pub fn call_bytes(
        &self,
        kind: CollKind,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        bufs: ByteBufs<'_>,
    ) -> Result<()> {
        if let ReduceOp::PreMulSum(scalar) = op {
            if kind.reduces() && op.check(dtype).is_ok() {
                return self.premul_sum(kind, dtype, scalar, root, bufs);
            }
        }
        self.call_checked(kind, dtype, op, root, bufs)
    }

    /// [`ReduceOp::PreMulSum`]: the input scaled into a copy (the caller's input is left as
    /// it was), then a sum; the call keeps the op for the fingerprint check. Plain sums never
    /// come here.
    fn premul_sum(
        &self,
        kind: CollKind,
        dtype: DataType,
        scalar: f64,
        root: usize,
        bufs: ByteBufs<'_>,
    ) -> Result<()> {
        let op = ReduceOp::PreMulSum(scalar);
        let (n, es) = (self.nranks, dtype.size());
        let (input, recv): (&[u8], &mut [u8]) = match bufs {
            ByteBufs::Separate { send, recv } => (send, recv),
            ByteBufs::InPlace(buf) => {
                let len = buf.len();
                if kind == CollKind::ReduceScatter && (len % (n * es) != 0) {
                    // Let validation name the bad length.
                    return self.call_checked(kind, dtype, op, root, ByteBufs::InPlace(buf));
                }
                let scaled = Self::scaled(dtype, scalar, buf);
                let recv = match kind {
                    CollKind::ReduceScatter => {
                        let b = len / n;
                        &mut buf[self.rank * b..(self.rank + 1) * b]
                    }
                    _ => buf,
                };
                let send = &bytemuck::cast_slice::<u64, u8>(&scaled)[..len];
                return self.call_checked(kind, dtype, op, root, ByteBufs::Separate { send, recv });
            }
        };
        let scaled = Self::scaled(dtype, scalar, input);
        let send = &bytemuck::cast_slice::<u64, u8>(&scaled)[..input.len()];
        self.call_checked(kind, dtype, op, root, ByteBufs::Separate { send, recv })
    }

    /// `input` times `scalar`, in an aligned copy.
    fn scaled(dtype: DataType, scalar: f64, input: &[u8]) -> Vec<u64> {
        let mut words = vec![0u64; input.len().div_ceil(8)];
        let copy = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..input.len()];
        copy.copy_from_slice(input);
        crate::base::reduce::scale_by(dtype, copy, scalar);
        words
    }

    fn call_checked(
        &self,
        kind: CollKind,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
        bufs: ByteBufs<'_>,
    ) -> Result<()> {
        let name = kind.name();
        let (n, r, es) = (self.nranks, self.rank, dtype.size());
        let (in_len, out_len, in_place, ptrs) = match &bufs {
            ByteBufs::Separate { send, recv } => (
                send.len(),
                recv.len(),
                false,
                [send.as_ptr() as usize, recv.as_ptr() as usize],
            ),
            ByteBufs::InPlace(b) => (b.len(), b.len(), true, [b.as_ptr() as usize; 2]),
        };
        let is_root = root == r;
        // Validation needs the call's sequence number: it runs inside `run`.
        // Element sizes are powers of two (`DataType::size`): masks and shifts instead of
        // divisions, which cost a few nanoseconds each on an 8-byte call.
        let (mask, shift) = (es - 1, es.trailing_zeros());
        let validate = |seq: u64| -> Result<Call> {
            let bad = |msg: String| Err(self.bad(name, seq, msg));
            if (in_len | out_len) & mask != 0 {
                return bad(format!("buffer lengths {in_len} and {out_len} bytes are not multiples of the {dtype} size {es}"));
            }
            let ignored = matches!(
                kind,
                CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
            ) && !is_root;
            if !in_place && !ignored && in_len > 0 && out_len > 0 {
                let (s, r) = (ptrs[0], ptrs[1]);
                if s < r + out_len && r < s + in_len {
                    return bad(format!("send ({in_len} bytes at {s:#x}) and recv ({out_len} bytes at {r:#x}) overlap: use the in-place form"));
                }
            }
            if (ptrs[0] | ptrs[1]) & mask != 0 {
                return bad(format!("buffers are not aligned for {dtype}"));
            }
            if kind.reduces() {
                if let Err(msg) = op.check(dtype) {
                    return bad(msg);
                }
            }
            let (ic, oc) = (in_len >> shift, out_len >> shift);
            let call = |kind, count| {
                Ok(Call {
                    kind,
                    count,
                    dtype,
                    op,
                    root,
                })
            };
            match kind {
                CollKind::AllReduce => {
                    if ic != oc {
                        return bad(format!("send has {ic} elements, recv {oc}"));
                    }
                    call(kind, oc)
                }
                CollKind::Broadcast | CollKind::Reduce => {
                    self.check_root(name, seq, root)?;
                    if is_root && ic != oc {
                        return bad(format!("the root's send has {ic} elements, recv {oc}"));
                    }
                    call(kind, if kind == CollKind::Broadcast { oc } else { ic })
                }
                CollKind::AllGather
                | CollKind::ReduceScatter
                | CollKind::AllToAll
                | CollKind::AllToAllV
                    if in_place =>
                {
                    if oc % n != 0 {
                        return bad(format!("{oc} elements do not divide among {n} ranks"));
                    }
                    call(kind, oc / n)
                }
                CollKind::AllGather => {
                    if Some(oc) != ic.checked_mul(n) {
                        return bad(format!(
                            "recv has {oc} elements; expected world size {n} x send {ic}"
                        ));
                    }
                    call(kind, ic)
                }
                CollKind::ReduceScatter => {
                    if Some(ic) != oc.checked_mul(n) {
                        return bad(format!(
                            "send has {ic} elements; expected world size {n} x recv {oc}"
                        ));
                    }
                    call(kind, oc)
                }
                CollKind::AllToAll | CollKind::AllToAllV => {
                    if ic != oc || ic % n != 0 {
                        return bad(format!("send ({ic}) and recv ({oc}) must have one length, divisible by the world size {n}"));
                    }
                    call(kind, ic / n)
                }
                CollKind::Send { peer } | CollKind::Recv { peer } => {
                    self.check_peer(name, seq, peer)?;
                    if in_place {
                        return bad(format!("{name} has no in-place form"));
                    }
                    call(
                        kind,
                        if matches!(kind, CollKind::Send { .. }) {
                            ic
                        } else {
                            oc
                        },
                    )
                }
                CollKind::SendRecv { to, from } => {
                    if ic != oc {
                        return bad(format!("send has {ic} elements, recv {oc}"));
                    }
                    if !(to == r && from == r) {
                        self.check_peer(name, seq, to)?;
                        self.check_peer(name, seq, from)?;
                    }
                    call(kind, ic)
                }
                CollKind::Barrier => call(kind, 0),
                CollKind::Gather | CollKind::Scatter => {
                    self.check_root(name, seq, root)?;
                    if in_place {
                        if is_root && oc % n != 0 {
                            return bad(format!("{oc} elements do not divide among {n} ranks"));
                        }
                        return call(kind, if is_root { oc / n } else { oc });
                    }
                    // The root's whole buffer holds every rank's block.
                    let (whole, block, w, b) = if kind == CollKind::Gather {
                        (oc, ic, "recv", "send")
                    } else {
                        (ic, oc, "send", "recv")
                    };
                    if is_root && Some(whole) != block.checked_mul(n) {
                        return bad(format!(
                            "the root's {w} has {whole} elements; expected world size {n} x {b} {block}"
                        ));
                    }
                    call(kind, block)
                }
            }
        };
        match bufs {
            _ if matches!(
                kind,
                CollKind::Gather | CollKind::Scatter | CollKind::AllToAllV
            ) =>
            {
                self.blocks_call(kind, dtype, root, bufs, |seq| validate(seq).map(|_| ()))
            }
            // Point-to-point goes through its engine (tags, the stash of early messages).
            ByteBufs::Separate { send, recv } if kind.is_p2p() => {
                let (to, from) = match kind {
                    CollKind::SendRecv { to, from } => (Some(to), Some(from)),
                    CollKind::Recv { peer } => (None, Some(peer)),
                    CollKind::Send { peer } => (Some(peer), None),
                    _ => (None, None),
                };
                let send = to.map(|peer| P2pOp::Send {
                    peer,
                    tag: 0,
                    dtype,
                    buf: send,
                });
                let recv = from.map(|peer| P2pOp::Recv {
                    peer: Some(peer),
                    tag: 0,
                    dtype,
                    buf: recv,
                    from: None,
                });
                let mut ops: Vec<P2pOp<'_>> = send.into_iter().chain(recv).collect();
                self.run_p2p(name, validate, &mut ops)
            }
            ByteBufs::Separate { send, recv } => {
                let send: &[u8] = if kind == CollKind::Broadcast && !is_root {
                    &[]
                } else {
                    send
                };
                let recv: &mut [u8] = if kind == CollKind::Reduce && !is_root {
                    &mut []
                } else {
                    recv
                };
                self.run(name, validate, Buffers::new(send, recv))
            }
            ByteBufs::InPlace(buf) => {
                let len = buf.len();
                let blk = |count: usize| r * count * es..(r + 1) * count * es;
                let (input, output) = match kind {
                    CollKind::Broadcast if !is_root => (0..0, 0..len),
                    CollKind::Reduce if !is_root => (0..len, 0..0),
                    CollKind::AllGather => (blk(len / es / n), 0..len),
                    CollKind::ReduceScatter => (0..len, blk(len / es / n)),
                    CollKind::AllToAll | CollKind::SendRecv { .. } => {
                        // Every byte is both sent and overwritten: send from an aligned copy
                        // (as MPI_Sendrecv_replace; a Vec<u8> need not be aligned).
                        let mut words = vec![0u64; len.div_ceil(8)];
                        let copy = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len];
                        copy.copy_from_slice(buf);
                        return self.call_bytes(
                            kind,
                            dtype,
                            op,
                            root,
                            ByteBufs::Separate {
                                send: copy,
                                recv: buf,
                            },
                        );
                    }
                    _ => (0..len, 0..len),
                };
                self.run(name, validate, Buffers::in_place(buf, input, output))
            }
        }
    }

    fn typed<T: Element>(
        &self,
        kind: CollKind,
        op: ReduceOp,
        root: usize,
        send: &[T],
        recv: &mut [T],
    ) -> Result<()> {
        let bufs = ByteBufs::Separate {
            send: bytemuck::cast_slice(send),
            recv: bytemuck::cast_slice_mut(recv),
        };
        self.call_bytes(kind, T::DTYPE, op, root, bufs)
    }

    fn typed_in_place<T: Element>(
        &self,
        kind: CollKind,
        op: ReduceOp,
        root: usize,
        buf: &mut [T],
    ) -> Result<()> {
        self.call_bytes(
            kind,
            T::DTYPE,
            op,
            root,
            ByteBufs::InPlace(bytemuck::cast_slice_mut(buf)),
        )
    }

    /// Every rank gets the element-wise reduction of every rank's `send` in `recv`
    /// (same length as `send`).
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// use oxccl::ReduceOp;
    /// let sums = on_ranks(2, |comm| {
    ///     let mine = [comm.rank() as f32 + 1.0; 4];
    ///     let mut sum = [0.0f32; 4];
    ///     comm.all_reduce(&mine, &mut sum, ReduceOp::Sum)?;
    ///     Ok(sum)
    /// });
    /// assert_eq!(sums, [[3.0; 4]; 2]);
    /// ```
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.typed(CollKind::AllReduce, op, 0, send, recv)
    }

    /// [`all_reduce`](Self::all_reduce) in place.
    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.typed_in_place(CollKind::AllReduce, op, 0, buf)
    }

    /// Every rank gets `root`'s `send` in `recv`. `send` is read on the root only (other
    /// ranks may pass an empty slice); on the root it must have `recv`'s length.
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// let got = on_ranks(2, |comm| {
    ///     // Only the root's input is read.
    ///     let weights = if comm.rank() == 0 { vec![0.5f64, 1.5, 2.5] } else { Vec::new() };
    ///     let mut out = vec![0.0f64; 3];
    ///     comm.broadcast(&weights, &mut out, 0)?;
    ///     Ok(out)
    /// });
    /// assert_eq!(got, [[0.5, 1.5, 2.5], [0.5, 1.5, 2.5]]);
    /// ```
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.typed(CollKind::Broadcast, ReduceOp::Sum, root, send, recv)
    }

    /// [`broadcast`](Self::broadcast) in place: `buf` is the source on the root and the
    /// destination elsewhere.
    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.typed_in_place(CollKind::Broadcast, ReduceOp::Sum, root, buf)
    }

    /// `root` gets the element-wise reduction of every rank's `send` in `recv`. `recv` is
    /// written on the root only (other ranks may pass an empty slice); on the root it must have
    /// `send`'s length.
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// use oxccl::ReduceOp;
    /// let got = on_ranks(2, |comm| {
    ///     let mine = [comm.rank() as i32 + 1; 3];
    ///     // Only the root (rank 1) gets the result.
    ///     let mut out = if comm.rank() == 1 { vec![0i32; 3] } else { Vec::new() };
    ///     comm.reduce(&mine, &mut out, ReduceOp::Max, 1)?;
    ///     Ok(out)
    /// });
    /// assert_eq!(got, [vec![], vec![2, 2, 2]]);
    /// ```
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.typed(CollKind::Reduce, op, root, send, recv)
    }

    /// [`reduce`](Self::reduce) in place: on the root `buf` is replaced by the result; other
    /// ranks' `buf` is only read.
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.typed_in_place(CollKind::Reduce, op, root, buf)
    }

    /// Every rank gets every rank's `send`, concatenated in rank order, in `recv`
    /// (`recv.len() == world_size * send.len()`).
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// let got = on_ranks(2, |comm| {
    ///     let mine = [comm.rank() as u32; 2];
    ///     let mut all = [0u32; 4];
    ///     comm.all_gather(&mine, &mut all)?;
    ///     Ok(all)
    /// });
    /// assert_eq!(got, [[0, 0, 1, 1]; 2]);
    /// ```
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.typed(CollKind::AllGather, ReduceOp::Sum, 0, send, recv)
    }

    /// [`all_gather`](Self::all_gather) in place: this rank's contribution is already in its
    /// block of `buf` (`buf[rank * len / world_size..]`).
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.typed_in_place(CollKind::AllGather, ReduceOp::Sum, 0, buf)
    }

    /// Rank r gets block r of the element-wise reduction of every rank's `send`
    /// (`send.len() == world_size * recv.len()`).
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// use oxccl::ReduceOp;
    /// let got = on_ranks(2, |comm| {
    ///     let mine = [1.0f32, 2.0, 3.0, 4.0]; // two blocks of two elements
    ///     let mut block = [0.0f32; 2];
    ///     comm.reduce_scatter(&mine, &mut block, ReduceOp::Sum)?;
    ///     Ok(block)
    /// });
    /// assert_eq!(got, [[2.0, 4.0], [6.0, 8.0]]);
    /// ```
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.typed(CollKind::ReduceScatter, op, 0, send, recv)
    }

    /// [`reduce_scatter`](Self::reduce_scatter) in place: the result lands in this rank's
    /// block of `buf` (`buf[rank * len / world_size..][..len / world_size]`); the other blocks
    /// are left as they were.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.typed_in_place(CollKind::ReduceScatter, op, 0, buf)
    }

    /// Block p of this rank's `send` goes to rank p, which stores it as block r of its `recv`
    /// (both `world_size` equal blocks, same length).
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// let got = on_ranks(2, |comm| {
    ///     let r = comm.rank() as i64;
    ///     let send = [10 * r, 10 * r + 1]; // block p goes to rank p
    ///     let mut recv = [0i64; 2];
    ///     comm.all_to_all(&send, &mut recv)?;
    ///     Ok(recv)
    /// });
    /// assert_eq!(got, [[0, 10], [1, 11]]);
    /// ```
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.typed(CollKind::AllToAll, ReduceOp::Sum, 0, send, recv)
    }

    /// [`all_to_all`](Self::all_to_all) in place (through a temporary copy of `buf`).
    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.typed_in_place(CollKind::AllToAll, ReduceOp::Sum, 0, buf)
    }

    /// Sends `buf` to `peer`, which must call [`recv`](Self::recv) with the same length.
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// let got = on_ranks(2, |comm| {
    ///     let mut buf = [0u8; 3];
    ///     if comm.rank() == 0 {
    ///         comm.send(&[1u8, 2, 3], 1)?;
    ///     } else {
    ///         comm.recv(&mut buf, 0)?;
    ///     }
    ///     Ok(buf)
    /// });
    /// assert_eq!(got[1], [1, 2, 3]);
    /// ```
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.typed::<T>(CollKind::Send { peer }, ReduceOp::Sum, 0, buf, &mut [])
    }

    /// Receives `buf.len()` elements from `peer`'s [`send`](Self::send).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.typed::<T>(CollKind::Recv { peer }, ReduceOp::Sum, 0, &[], buf)
    }

    /// Sends `send` to `to` while receiving `recv` from `from`, as `MPI_Sendrecv` (both of one
    /// length; `to == from == rank` copies locally).
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        self.typed(
            CollKind::SendRecv { to, from },
            ReduceOp::Sum,
            0,
            send,
            recv,
        )
    }

    /// Returns once every rank has called it.
    ///
    /// # Example
    ///
    /// Two ranks, each a thread of this process with its own communicator (`on_ranks(n, f)`
    /// runs `f` on each, as the [crate-level example](crate) does, and returns their results in
    /// rank order):
    ///
    /// ```
    /// # use oxccl::{Communicator, UniqueId};
    /// # fn on_ranks<R: Send + 'static>(n: usize, f: fn(&Communicator) -> oxccl::Result<R>) -> Vec<R> {
    /// #     let id = UniqueId::new_on(std::net::Ipv4Addr::LOCALHOST.into()).unwrap();
    /// #     let ranks: Vec<_> = (0..n)
    /// #         .map(|rank| {
    /// #             let id = id.clone();
    /// #             let comm = move || Communicator::init(&id, rank, n).unwrap();
    /// #             std::thread::spawn(move || f(&comm()).unwrap())
    /// #         })
    /// #         .collect();
    /// #     ranks.into_iter().map(|h| h.join().unwrap()).collect()
    /// # }
    /// let done = on_ranks(2, |comm| comm.barrier());
    /// assert_eq!(done.len(), 2);
    /// ```
    pub fn barrier(&self) -> Result<()> {
        self.typed::<u8>(CollKind::Barrier, ReduceOp::Sum, 0, &[], &mut [])
    }
}

/// The buffers of a byte-level call ([`Communicator::call_bytes`]).
#[derive(Debug)]
pub enum ByteBufs<'a> {
    /// Separate input and output.
    Separate {
        /// The input.
        send: &'a [u8],
        /// The output.
        recv: &'a mut [u8],
    },
    /// One buffer, used in place.
    InPlace(&'a mut [u8]),
}

/// `buf` in `n` blocks of equal length (`buf.len()` a multiple of `n`).
fn split(buf: &[u8], n: usize) -> Vec<&[u8]> {
    let b = buf.len() / n.max(1);
    (0..n).map(|p| &buf[p * b..(p + 1) * b]).collect()
}

/// `buf` in `n` blocks of equal length (`buf.len()` a multiple of `n`), mutably.
fn split_mut(mut buf: &mut [u8], n: usize) -> Vec<&mut [u8]> {
    let b = buf.len() / n.max(1);
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(b);
        v.push(head);
        buf = tail;
    }
    v
}
