//! Algorithms as schedules: each collective algorithm turns a call ([`Coll`]) into a
//! [`Schedule`] of steps, each step a set of sends and receives over byte ranges of the
//! call's buffers. Schedules do no I/O: they are checked here against a deterministic
//! in-memory simulator (`sim`, in tests), and run over real links by `exec`.
//!
//! One file per algorithm, named `<collective>_<algorithm>` as in Gloo. docs/algorithms.md
//! lists each one's steps and bytes on the wire.

use std::fmt;
use std::sync::Arc;

use crate::base::dtype::DataType;
use crate::base::op::ReduceOp;
use crate::bootstrap::topo::Topology;

pub(crate) use blocks::Blocks;

pub(crate) mod allgather_ring;
pub(crate) mod allreduce_halving_doubling;
pub(crate) mod allreduce_hier;
pub(crate) mod allreduce_ring;
pub(crate) mod allreduce_tree;
pub(crate) mod alltoall_pairwise;
pub(crate) mod alltoallv_flat;
pub(crate) mod barrier_dissemination;
pub(crate) mod blocks;
pub(crate) mod broadcast_chain;
pub(crate) mod gather_flat;
pub(crate) mod ordered;
pub(crate) mod placement;
pub(crate) mod reduce_chain;
pub(crate) mod reduce_scatter_ring;
pub(crate) mod scatter_flat;
pub(crate) mod sendrecv;
#[cfg(test)]
pub(crate) mod sim;

/// Which collective a call is.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CollKind {
    /// Everyone gets the reduction of everyone's buffer.
    AllReduce,
    /// Everyone gets the root's buffer.
    Broadcast,
    /// The root gets the reduction of everyone's buffer.
    Reduce,
    /// Everyone gets everyone's buffer, concatenated by rank.
    AllGather,
    /// Rank r gets block r of the reduction of everyone's buffer.
    ReduceScatter,
    /// Rank r's block p goes to rank p's block r.
    AllToAll,
    /// Send to one peer and receive from another at once.
    SendRecv {
        /// Where this rank's input goes.
        to: usize,
        /// Where this rank's output comes from.
        from: usize,
    },
    /// Send to one peer.
    Send {
        /// The receiving rank.
        peer: usize,
    },
    /// Receive from one peer.
    Recv {
        /// The sending rank.
        peer: usize,
    },
    /// Wait until every rank has arrived.
    Barrier,
    /// The root gets every rank's block (blocks may differ in size).
    Gather,
    /// Every rank gets its block of the root's buffer (blocks may differ in size).
    Scatter,
    /// Rank r's block p goes to rank p's block r, blocks of any size (all_to_allv).
    AllToAllV,
}

impl CollKind {
    /// The call's name in errors and benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllGather => "all_gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::AllToAll => "all_to_all",
            CollKind::SendRecv { .. } => "sendrecv",
            CollKind::Send { .. } => "send",
            CollKind::Recv { .. } => "recv",
            CollKind::Barrier => "barrier",
            CollKind::Gather => "gather",
            CollKind::Scatter => "scatter",
            CollKind::AllToAllV => "all_to_allv",
        }
    }

    /// True for point-to-point calls (send, recv, sendrecv).
    pub fn is_p2p(self) -> bool {
        matches!(
            self,
            CollKind::Send { .. } | CollKind::Recv { .. } | CollKind::SendRecv { .. }
        )
    }

    /// True for the collectives that reduce (all_reduce, reduce, reduce_scatter).
    pub fn reduces(self) -> bool {
        matches!(
            self,
            CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
        )
    }
}

/// One call as every algorithm sees it. Counts follow NCCL: `count` is the whole buffer for
/// all_reduce, broadcast and reduce; one rank's block for all_gather (input), reduce_scatter
/// (output) and all_to_all (per peer); the message for send/recv.
#[derive(Clone, Debug)]
pub struct Coll {
    /// The collective.
    pub kind: CollKind,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub nranks: usize,
    /// Elements, as described above.
    pub count: usize,
    /// Element type.
    pub dtype: DataType,
    /// Reduction op (ignored by collectives that do not reduce).
    pub op: ReduceOp,
    /// Root rank (broadcast and reduce).
    pub root: usize,
    /// Pipeline segment in bytes for chained algorithms.
    pub chunk_bytes: usize,
    /// Which host each rank is on (`None`: one host, or unknown). Rings and chains follow
    /// host order (crossing each host boundary once); hierarchical algorithms need it.
    pub topo: Option<Arc<Topology>>,
    /// The blocks this rank sends and receives, for the collectives whose blocks may differ
    /// in size (gather, scatter, all_to_allv; `None` for every other collective).
    pub(crate) blocks: Option<Arc<Blocks>>,
}

impl Coll {
    /// Bytes of the input buffer this rank passes (0 where the call has none).
    pub fn input_bytes(&self) -> usize {
        let es = self.dtype.size();
        match self.kind {
            CollKind::AllReduce | CollKind::Reduce | CollKind::AllGather => self.count * es,
            CollKind::Broadcast => {
                if self.rank == self.root {
                    self.count * es
                } else {
                    0
                }
            }
            CollKind::ReduceScatter | CollKind::AllToAll => self.count * self.nranks * es,
            CollKind::SendRecv { .. } | CollKind::Send { .. } => self.count * es,
            CollKind::Recv { .. } | CollKind::Barrier => 0,
            CollKind::Gather | CollKind::Scatter | CollKind::AllToAllV => {
                self.blocks.as_ref().map_or(0, |b| b.input_bytes())
            }
        }
    }

    /// Bytes of the output buffer this rank passes (0 where the call has none).
    pub fn output_bytes(&self) -> usize {
        let es = self.dtype.size();
        match self.kind {
            CollKind::AllReduce | CollKind::Broadcast => self.count * es,
            CollKind::Reduce => {
                if self.rank == self.root {
                    self.count * es
                } else {
                    0
                }
            }
            CollKind::ReduceScatter => self.count * es,
            CollKind::AllGather | CollKind::AllToAll => self.count * self.nranks * es,
            CollKind::SendRecv { .. } | CollKind::Recv { .. } => self.count * es,
            CollKind::Send { .. } | CollKind::Barrier => 0,
            CollKind::Gather | CollKind::Scatter | CollKind::AllToAllV => {
                self.blocks.as_ref().map_or(0, |b| b.output_bytes())
            }
        }
    }
}

/// A buffer of the call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Buf {
    /// The caller's input (for in-place calls, an alias into the output).
    Input,
    /// The caller's output.
    Output,
    /// Scratch memory the executor provides ([`Schedule::scratch_bytes`]).
    Scratch,
}

/// A byte range of one buffer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BufRange {
    /// Which buffer.
    pub buf: Buf,
    /// Offset in bytes.
    pub off: usize,
    /// Length in bytes.
    pub len: usize,
}

impl BufRange {
    /// A region of `buf`.
    pub const fn new(buf: Buf, off: usize, len: usize) -> Self {
        BufRange { buf, off, len }
    }
}

/// What a receive does with the bytes that arrive.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Combine {
    /// Store them in the destination.
    Store,
    /// `dst = with ⊕ incoming` (`with` may be `dst` itself).
    Reduce {
        /// The local operand, same length as the destination.
        with: BufRange,
    },
}

/// A transfer between this rank and one peer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Xfer {
    /// Send a region to a peer.
    Send {
        /// The receiving rank.
        peer: usize,
        /// What to send.
        src: BufRange,
    },
    /// Receive into a region from a peer.
    Recv {
        /// The sending rank.
        peer: usize,
        /// Where the bytes go.
        dst: BufRange,
        /// How they are combined.
        combine: Combine,
    },
}

/// Local work done without a peer.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Local {
    /// Copy `src` to `dst` (same length; skipped when they are the same memory).
    Copy {
        /// Source.
        src: BufRange,
        /// Destination.
        dst: BufRange,
    },
    /// Divide every element of a region by the number of ranks (the end of an average).
    DivideByRanks(BufRange),
    /// `dst = dst ⊕ src` element-wise (same length, no overlap).
    Reduce {
        /// The accumulator.
        dst: BufRange,
        /// The operand.
        src: BufRange,
    },
}

/// One step: local work before, transfers that progress together, local work after. A rank
/// starts step k+1 once its own transfers of step k are complete.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Local work before the transfers.
    pub before: Vec<Local>,
    /// Transfers, progressed concurrently. At most one send and one receive per peer.
    pub xfers: Vec<Xfer>,
    /// Local work after the transfers.
    pub after: Vec<Local>,
}

/// A whole algorithm for one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The algorithm's name (printed in `oxccl perf`'s `algo` column).
    pub algo: &'static str,
    /// Steps, in order.
    pub steps: Vec<Step>,
    /// Scratch bytes the schedule needs.
    pub scratch_bytes: usize,
}

impl Schedule {
    /// An empty schedule named `algo`.
    pub fn new(algo: &'static str) -> Self {
        Schedule {
            algo,
            ..Default::default()
        }
    }

    /// Appends a step made only of transfers (zero-length ones dropped).
    pub fn push_xfers(&mut self, xfers: impl IntoIterator<Item = Xfer>) {
        let xfers: Vec<Xfer> = xfers.into_iter().filter(|x| !x.is_empty()).collect();
        if !xfers.is_empty() {
            self.steps.push(Step {
                xfers,
                ..Default::default()
            });
        }
    }

    /// Appends local work to the last step (or a new step if there is none).
    pub fn push_local(&mut self, local: Local) {
        if local.is_empty() {
            return;
        }
        match self.steps.last_mut() {
            Some(s) => s.after.push(local),
            None => self.steps.push(Step {
                after: vec![local],
                ..Default::default()
            }),
        }
    }

    /// Bytes this rank sends over the whole schedule.
    pub fn bytes_sent(&self) -> usize {
        self.steps
            .iter()
            .flat_map(|s| &s.xfers)
            .map(|x| match x {
                Xfer::Send { src, .. } => src.len,
                Xfer::Recv { .. } => 0,
            })
            .sum()
    }

    /// Checks the invariants the executor relies on: within a step, at most one send and one
    /// receive per peer; no region a step writes overlaps one it reads or writes elsewhere in
    /// that step (a reduce may read its own destination); no peer equal to `rank`.
    pub fn validate(&self, rank: usize) -> Result<(), String> {
        for (i, step) in self.steps.iter().enumerate() {
            let mut sends = Vec::new();
            let mut recvs = Vec::new();
            let mut reads: Vec<BufRange> = Vec::new();
            let mut writes: Vec<BufRange> = Vec::new();
            for x in &step.xfers {
                match *x {
                    Xfer::Send { peer, src } => {
                        if peer == rank || sends.contains(&peer) {
                            return Err(format!("step {i}: bad or repeated send peer {peer}"));
                        }
                        sends.push(peer);
                        reads.push(src);
                    }
                    Xfer::Recv { peer, dst, combine } => {
                        if peer == rank || recvs.contains(&peer) {
                            return Err(format!("step {i}: bad or repeated recv peer {peer}"));
                        }
                        recvs.push(peer);
                        if let Combine::Reduce { with } = combine {
                            if with.len != dst.len {
                                return Err(format!("step {i}: reduce operand length differs"));
                            }
                            if with != dst {
                                reads.push(with);
                            }
                        }
                        writes.push(dst);
                    }
                }
            }
            for (k, w) in writes.iter().enumerate() {
                let clash = writes
                    .iter()
                    .enumerate()
                    .any(|(j, o)| j != k && overlaps(w, o))
                    || reads.iter().any(|r| overlaps(w, r));
                if clash {
                    return Err(format!(
                        "step {i}: written region {w:?} overlaps another region"
                    ));
                }
            }
        }
        Ok(())
    }
}

fn overlaps(a: &BufRange, b: &BufRange) -> bool {
    a.buf == b.buf && a.len > 0 && b.len > 0 && a.off < b.off + b.len && b.off < a.off + a.len
}

impl Xfer {
    /// Bytes moved.
    pub fn len(&self) -> usize {
        match self {
            Xfer::Send { src, .. } => src.len,
            Xfer::Recv { dst, .. } => dst.len,
        }
    }

    /// True when no bytes move.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The peer.
    pub fn peer(&self) -> usize {
        match *self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => peer,
        }
    }
}

impl Local {
    /// Bytes touched.
    pub fn len(&self) -> usize {
        match self {
            Local::Copy { src, .. } => src.len,
            Local::DivideByRanks(r) => r.len,
            Local::Reduce { dst, .. } => dst.len,
        }
    }

    /// True when it touches nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Block `i` of `count` elements split into `n` nearly equal blocks: `(first element, len)`.
/// The first `count % n` blocks are one element longer.
pub(crate) fn block(count: usize, n: usize, i: usize) -> (usize, usize) {
    let base = count / n;
    let extra = count % n;
    let start = i * base + i.min(extra);
    (start, base + usize::from(i < extra))
}

/// Splits `len` elements into pipeline segments of at most `chunk_bytes` (at least one
/// element each): `(first element, len)` pairs.
pub(crate) fn segments(
    len: usize,
    es: usize,
    chunk_bytes: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let per = (chunk_bytes / es).max(1);
    (0..len.div_ceil(per)).map(move |k| (k * per, per.min(len - k * per)))
}

/// `(a - b) mod n` for ranks.
pub(crate) fn sub_mod(a: usize, b: usize, n: usize) -> usize {
    (a + n - b % n) % n
}

/// The algorithms oxccl has, by name.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Ring (all_reduce, all_gather, reduce_scatter).
    Ring,
    /// Pipelined chain (broadcast, reduce).
    Chain,
    /// Pairwise exchange (all_to_all).
    Pairwise,
    /// Dissemination (barrier).
    Dissemination,
    /// Point-to-point transfer over the links (send, recv). Named `direct` (`OXCCL_ALGO`,
    /// perf `-a`, traces): the bytes go straight from sender to receiver, not through the
    /// direct area ([`on_direct_area`](Self::on_direct_area) is false).
    PointToPoint,
    /// One-shot through shared slots (one host, small messages; not a schedule).
    OneShot,
    /// Single copy between ranks' buffers with `process_vm_readv`/`writev` (one host; not a
    /// schedule).
    Cma,
    /// Reductions in rank order, for bitwise reproducibility (`OXCCL_DETERMINISTIC=1`).
    Ordered,
    /// Hierarchical all_reduce: reduce-scatter inside each host, all-reduce across hosts,
    /// all-gather inside each host.
    Hier,
    /// Tree all_reduce for small messages: reduce to each host's leader, recursive doubling
    /// among leaders, broadcast from the leader.
    Tree,
    /// Halving-doubling (Rabenseifner) all_reduce: reduce-scatter by recursive halving, then
    /// all-gather by recursive doubling; the ring's bytes in `2·log2 n` steps.
    HalvingDoubling,
    /// Every block straight between the two ranks it concerns, all in one step (gather,
    /// scatter, all_to_allv, whose blocks may differ in size).
    Flat,
}

impl Algo {
    /// Every algorithm.
    pub const ALL: [Algo; 12] = [
        Algo::Ring,
        Algo::Chain,
        Algo::Pairwise,
        Algo::Dissemination,
        Algo::PointToPoint,
        Algo::OneShot,
        Algo::Cma,
        Algo::Ordered,
        Algo::Hier,
        Algo::Tree,
        Algo::HalvingDoubling,
        Algo::Flat,
    ];

    /// The algorithm's name.
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::Chain => "chain",
            Algo::Pairwise => "pairwise",
            Algo::Dissemination => "dissemination",
            Algo::PointToPoint => "direct",
            Algo::OneShot => "oneshot",
            Algo::Cma => "cma",
            Algo::Ordered => "ordered",
            Algo::Hier => "hier",
            Algo::Tree => "tree",
            Algo::HalvingDoubling => "hd",
            Algo::Flat => "flat",
        }
    }

    /// True for the algorithms whose reductions combine the ranks' values in rank order
    /// (`((x0 ⊕ x1) ⊕ x2) ...`), so that their results are identical, bit for bit, to each
    /// other's and from run to run.
    pub fn rank_ordered(self) -> bool {
        matches!(self, Algo::OneShot | Algo::Cma | Algo::Ordered)
    }

    /// True for the algorithms that work on the direct area of one host (one-shot slots and
    /// single-copy, `direct/`) instead of a schedule over links.
    pub fn on_direct_area(self) -> bool {
        matches!(self, Algo::OneShot | Algo::Cma)
    }

    /// Whether this algorithm implements `kind`.
    pub fn supports(self, kind: CollKind) -> bool {
        matches!(
            (self, kind),
            (
                Algo::Ring,
                CollKind::AllReduce | CollKind::AllGather | CollKind::ReduceScatter
            ) | (Algo::Chain, CollKind::Broadcast | CollKind::Reduce)
                | (Algo::Pairwise, CollKind::AllToAll)
                | (Algo::Dissemination, CollKind::Barrier)
                | (
                    Algo::Flat,
                    CollKind::Gather | CollKind::Scatter | CollKind::AllToAllV
                )
                | (
                    Algo::Hier | Algo::Tree | Algo::HalvingDoubling,
                    CollKind::AllReduce
                )
                | (
                    Algo::OneShot,
                    CollKind::AllReduce
                        | CollKind::Broadcast
                        | CollKind::Reduce
                        | CollKind::AllGather
                        | CollKind::ReduceScatter
                        | CollKind::AllToAll
                        | CollKind::Barrier
                )
                | (
                    Algo::Ordered,
                    CollKind::AllReduce | CollKind::ReduceScatter | CollKind::Reduce
                )
                | (
                    Algo::Cma,
                    CollKind::AllReduce
                        | CollKind::ReduceScatter
                        | CollKind::Reduce
                        | CollKind::AllGather
                        | CollKind::AllToAll
                        | CollKind::Broadcast
                )
                | (
                    Algo::PointToPoint,
                    CollKind::SendRecv { .. } | CollKind::Send { .. } | CollKind::Recv { .. }
                )
        )
    }

    /// Builds this algorithm's schedule for `coll`. Panics if it does not
    /// [`support`](Self::supports) the collective or [`on_direct_area`](Self::on_direct_area) (the
    /// tuner never asks for that).
    pub fn schedule(self, coll: &Coll) -> Schedule {
        match (self, coll.kind) {
            (Algo::Ring, CollKind::AllReduce) => allreduce_ring::schedule(coll),
            (Algo::Hier, CollKind::AllReduce) => allreduce_hier::schedule(coll),
            (Algo::Tree, CollKind::AllReduce) => allreduce_tree::schedule(coll),
            (Algo::HalvingDoubling, CollKind::AllReduce) => {
                allreduce_halving_doubling::schedule(coll)
            }
            (Algo::Ring, CollKind::AllGather) => allgather_ring::schedule(coll),
            (Algo::Ring, CollKind::ReduceScatter) => reduce_scatter_ring::schedule(coll),
            (Algo::Chain, CollKind::Broadcast) => broadcast_chain::schedule(coll),
            (Algo::Chain, CollKind::Reduce) => reduce_chain::schedule(coll),
            (Algo::Pairwise, CollKind::AllToAll) => alltoall_pairwise::schedule(coll),
            (Algo::Dissemination, CollKind::Barrier) => barrier_dissemination::schedule(coll),
            (Algo::Flat, CollKind::Gather) => gather_flat::schedule(coll),
            (Algo::Flat, CollKind::Scatter) => scatter_flat::schedule(coll),
            (Algo::Flat, CollKind::AllToAllV) => alltoallv_flat::schedule(coll),
            (Algo::Ordered, _) if self.supports(coll.kind) => ordered::schedule(coll),
            (Algo::PointToPoint, _) if self.supports(coll.kind) => sendrecv::schedule(coll),
            (a, k) => panic!("algorithm {} does not implement {}", a.name(), k.name()),
        }
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Algo::ALL
            .into_iter()
            .find(|a| a.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                let names: Vec<_> = Algo::ALL.iter().map(|a| a.name()).collect();
                format!("unknown algorithm '{s}' (known: {})", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_exactly() {
        for count in [0, 1, 2, 7, 8, 9, 100] {
            for n in 1..9 {
                let mut next = 0;
                for i in 0..n {
                    let (s, l) = block(count, n, i);
                    assert_eq!(s, next);
                    next += l;
                }
                assert_eq!(next, count);
            }
        }
        let segs: Vec<_> = segments(10, 4, 12).collect();
        assert_eq!(segs, vec![(0, 3), (3, 3), (6, 3), (9, 1)]);
        assert_eq!(segments(0, 4, 12).count(), 0);
        assert_eq!(segments(3, 8, 4).count(), 3);
    }
}
