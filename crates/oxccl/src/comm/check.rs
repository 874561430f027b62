//! Reference data and results for checking collectives (the tests, `oxccl perf -c 1`).
//!
//! Every rank fills its buffers with small integers ([`value`]) so that every reduction is
//! exact in every type, bf16 included (sums stay below 256, products are powers of two), and
//! the expected result of each collective can be computed independently, element by element,
//! with wide arithmetic ([`reduced`]), then wrapped to the type's width as the integer kernels
//! do.

use half::{bf16, f16};

use crate::base::dtype::DataType;
use crate::base::error::{Error, Result};
use crate::base::op::ReduceOp;
use crate::comm::{ByteBufs, Communicator};
use crate::direct::shared_buffer::SharedBuffer;
use crate::exec::p2p::P2pOp;
use crate::sched::{alltoallv_flat, gather_flat, scatter_flat, Coll, CollKind};

enum Storage {
    /// Words (8-byte aligned for every dtype) and the length in bytes.
    Private(Vec<u64>, usize),
    Shared(SharedBuffer),
}

impl Storage {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Storage::Private(w, len) => &mut bytemuck::cast_slice_mut::<u64, u8>(w)[..*len],
            Storage::Shared(b) => b,
        }
    }
}

/// The send and receive buffers of a [`Case`] ([`Case::buffers`]).
pub struct CaseBuffers {
    send: Storage,
    recv: Storage,
}

impl CaseBuffers {
    /// (send, recv) as bytes.
    pub fn get(&mut self) -> (&mut [u8], &mut [u8]) {
        (self.send.bytes(), self.recv.bytes())
    }
}

/// Every collective a matrix test covers, with its root: broadcast and reduce from the first
/// and from the last rank; `SendRecv` sends to the next rank and receives from the previous.
pub fn kinds(nranks: usize) -> Vec<(CollKind, usize)> {
    let mut k = vec![
        (CollKind::AllReduce, 0),
        (CollKind::AllGather, 0),
        (CollKind::ReduceScatter, 0),
        (CollKind::AllToAll, 0),
        (CollKind::SendRecv { to: 0, from: 0 }, 0),
    ];
    for root in [0, nranks.saturating_sub(1)] {
        k.push((CollKind::Broadcast, root));
        k.push((CollKind::Reduce, root));
    }
    k
}

/// The ops a matrix covers on `dtype`: every op defined on it, premul_sum with a scalar exact
/// in every type (a half for floats, 3 otherwise).
pub fn ops(dtype: DataType) -> Vec<ReduceOp> {
    let scalar = if dtype.is_float() { 0.5 } else { 3.0 };
    ReduceOp::ALL
        .into_iter()
        .chain(ReduceOp::BITWISE)
        .chain([ReduceOp::PreMulSum(scalar)])
        .filter(|op| op.check(dtype).is_ok())
        .collect()
}

/// The correctness matrix for `rank` of `nranks`: every collective of [`kinds`] × every
/// dtype × every op of [`ops`] (for the reductions; sum otherwise) × each of `counts` × out of
/// place and in place.
pub fn matrix(rank: usize, nranks: usize, counts: &[usize]) -> Vec<Case> {
    let mut cases = Vec::new();
    for (kind, root) in kinds(nranks) {
        let reduces = matches!(
            kind,
            CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
        );
        for dtype in DataType::ALL {
            let ops = if reduces {
                ops(dtype)
            } else {
                vec![ReduceOp::Sum]
            };
            for op in ops {
                for &count in counts {
                    for in_place in [false, true] {
                        cases.push(Case {
                            kind,
                            dtype,
                            op,
                            root,
                            count,
                            in_place,
                            rank,
                            nranks,
                        });
                    }
                }
            }
        }
    }
    cases
}

/// One collective call with reference data: buffers to fill, the call, and the check.
#[derive(Clone, Debug)]
pub struct Case {
    /// The collective (`SendRecv` sends to `rank + 1` and receives from `rank - 1`).
    pub kind: CollKind,
    /// Element type.
    pub dtype: DataType,
    /// Reduction op (also selects the reference values).
    pub op: ReduceOp,
    /// Root of broadcast and reduce.
    pub root: usize,
    /// Elements, with NCCL's meaning per collective (as `Coll` in `sched/mod.rs`).
    pub count: usize,
    /// Whether the call runs in place.
    pub in_place: bool,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub nranks: usize,
}

impl Case {
    fn coll(&self) -> Coll {
        let block = vec![self.count * self.dtype.size(); self.nranks];
        let (r, root) = (self.rank, self.root);
        let blocks = match self.kind {
            CollKind::Gather => Some(gather_flat::blocks(r, root, &block)),
            CollKind::Scatter => Some(scatter_flat::blocks(r, root, &block)),
            CollKind::AllToAllV => Some(alltoallv_flat::blocks(r, self.nranks, |_, _| block[0])),
            _ => None,
        };
        Coll {
            kind: self.kind,
            rank: self.rank,
            nranks: self.nranks,
            count: self.count,
            dtype: self.dtype,
            op: self.op,
            root: self.root,
            chunk_bytes: 1,
            topo: None,
            blocks: blocks.map(std::sync::Arc::new),
        }
    }

    /// Bytes of the (send, recv) buffers; for in-place calls send is 0 and recv is the buffer.
    pub fn sizes(&self) -> (usize, usize) {
        let c = self.coll();
        let (i, o) = (c.input_bytes(), c.output_bytes());
        if self.in_place {
            (0, i.max(o))
        } else {
            (i, o)
        }
    }

    /// Zeroed, aligned (send, recv) buffers of the right [`sizes`](Self::sizes): private memory,
    /// or shared buffers of `shared` ([`Communicator::alloc_shared`]).
    pub fn buffers(&self, shared: Option<&Communicator>) -> Result<CaseBuffers> {
        let (s, r) = self.sizes();
        let invalid = |msg: String| Error::InvalidArgument {
            rank: self.rank,
            call: "buffers",
            seq: 0,
            msg,
        };
        crate::base::mem::check_fits(
            (s as u64).saturating_add(r as u64),
            &format!("the send and receive buffers of {:?}", self.kind),
        )
        .map_err(invalid)?;
        let make = |len: usize| -> Result<Storage> {
            Ok(match shared {
                Some(c) => Storage::Shared(c.alloc_shared(len)?),
                None => Storage::Private(
                    crate::base::mem::try_zeroed(len.div_ceil(8), "a test buffer")
                        .map_err(invalid)?,
                    len,
                ),
            })
        };
        Ok(CaseBuffers {
            send: make(s)?,
            recv: make(r)?,
        })
    }

    fn input_value(&self, g: usize) -> f64 {
        value(self.op, self.rank, g) as f64
    }

    /// Fills the buffers with this rank's reference input (and a marker pattern where the
    /// call must write).
    pub fn fill(&self, send: &mut [u8], recv: &mut [u8]) {
        let d = self.dtype;
        let es = d.size();
        recv.fill(0x55);
        if !self.in_place {
            fill(d, send, |g| self.input_value(g));
            return;
        }
        let is_root = self.rank == self.root;
        match self.kind {
            CollKind::AllGather => {
                let b = self.count * es;
                fill(d, &mut recv[self.rank * b..(self.rank + 1) * b], |g| {
                    self.input_value(g)
                });
            }
            // The root's own block, at its place.
            CollKind::Gather if is_root => {
                let b = self.count * es;
                fill(d, &mut recv[self.rank * b..(self.rank + 1) * b], |g| {
                    self.input_value(g)
                });
            }
            CollKind::Broadcast | CollKind::Scatter if !is_root => {}
            _ => fill(d, recv, |g| self.input_value(g)),
        }
    }

    /// Runs the call on `comm` with buffers prepared by [`fill`](Self::fill).
    pub fn call(&self, comm: &Communicator, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let kind = match self.kind {
            CollKind::SendRecv { .. } => CollKind::SendRecv {
                to: (self.rank + 1) % self.nranks,
                from: (self.rank + self.nranks - 1) % self.nranks,
            },
            k => k,
        };
        let bufs = if self.in_place {
            ByteBufs::InPlace(recv)
        } else {
            ByteBufs::Separate { send, recv }
        };
        comm.call_bytes(kind, self.dtype, self.op, self.root, bufs)
    }

    /// Counts the wrong elements of the result in `recv`, against a reference computed here
    /// element by element.
    pub fn wrong(&self, recv: &[u8]) -> usize {
        let (d, op, n, r, c) = (self.dtype, self.op, self.nranks, self.rank, self.count);
        let es = d.size();
        let is_root = r == self.root;
        let nc = c.max(1);
        match self.kind {
            CollKind::AllReduce => count_wrong(d, op, recv, |g| reduced(d, op, n, g)),
            CollKind::Broadcast => count_wrong(d, op, recv, |g| value(op, self.root, g) as f64),
            CollKind::Reduce if is_root => count_wrong(d, op, recv, |g| reduced(d, op, n, g)),
            CollKind::Reduce if self.in_place => {
                count_wrong(d, op, recv, |g| value(op, r, g) as f64)
            }
            CollKind::Reduce => 0,
            CollKind::AllGather => count_wrong(d, op, recv, |j| value(op, j / nc, j % nc) as f64),
            CollKind::ReduceScatter => {
                let out = if self.in_place {
                    &recv[r * c * es..(r + 1) * c * es]
                } else {
                    recv
                };
                let mut wrong = count_wrong(d, op, out, |i| reduced(d, op, n, r * c + i));
                if self.in_place {
                    // The other blocks must be left as they were.
                    wrong += count_wrong(d, op, &recv[..r * c * es], |g| value(op, r, g) as f64);
                    wrong += count_wrong(d, op, &recv[(r + 1) * c * es..], |g| {
                        value(op, r, (r + 1) * c + g) as f64
                    });
                }
                wrong
            }
            CollKind::AllToAll | CollKind::AllToAllV => {
                count_wrong(d, op, recv, |j| value(op, j / nc, r * c + j % nc) as f64)
            }
            CollKind::Gather if is_root => {
                count_wrong(d, op, recv, |j| value(op, j / nc, j % nc) as f64)
            }
            // In place, the root's buffer is its input, untouched.
            CollKind::Scatter if is_root && self.in_place => {
                count_wrong(d, op, recv, |g| value(op, r, g) as f64)
            }
            CollKind::Scatter => {
                count_wrong(d, op, recv, |i| value(op, self.root, r * c + i) as f64)
            }
            CollKind::SendRecv { .. } => {
                count_wrong(d, op, recv, |g| value(op, (r + n - 1) % n, g) as f64)
            }
            CollKind::Send { .. }
            | CollKind::Recv { .. }
            | CollKind::Barrier
            | CollKind::Gather => 0,
        }
    }
}

/// What `rank` contributes at global element index `g` for a call reducing with `op`.
pub fn value(op: ReduceOp, rank: usize, g: usize) -> i64 {
    match op {
        // Products of 1s and 2s: powers of two, exact in every float type.
        ReduceOp::Prod => 1 + (rank + g).is_multiple_of(3) as i64,
        _ => ((rank * 3 + g * 7) % 4) as i64,
    }
}

/// The reduction over `nranks` ranks of [`value`] at element `g` as `dtype` holds the values
/// (bools as 0 and 1), as a float of the result for float types (an average of integers need
/// not be an integer). A premul_sum's scalar is taken to be every rank's.
pub fn reduced(dtype: DataType, op: ReduceOp, nranks: usize, g: usize) -> f64 {
    let held = |v: i64| {
        if dtype == DataType::Bool {
            (v != 0) as i64
        } else {
            v
        }
    };
    let vals = (0..nranks).map(|r| held(value(op, r, g)));
    match op {
        ReduceOp::Sum => vals.sum::<i64>() as f64,
        ReduceOp::Prod => vals.product::<i64>() as f64,
        ReduceOp::Min => vals.min().unwrap_or(0) as f64,
        ReduceOp::Max => vals.max().unwrap_or(0) as f64,
        ReduceOp::Avg => vals.sum::<i64>() as f64 / nranks as f64,
        ReduceOp::BAnd => vals.fold(-1, |a, b| a & b) as f64,
        ReduceOp::BOr => vals.fold(0, |a, b| a | b) as f64,
        ReduceOp::BXor => vals.fold(0, |a, b| a ^ b) as f64,
        ReduceOp::PreMulSum(s) => vals.map(|v| v as f64 * s).sum(),
    }
}

/// `x` (an integer-valued or, for averages, any value) in `dtype`'s representation: integers
/// truncate toward zero and wrap to the type's width, floats round to nearest.
pub fn encode(dtype: DataType, x: f64, out: &mut [u8]) {
    let w = x.trunc() as i128;
    match dtype {
        DataType::I8 => out.copy_from_slice(&(w as i8).to_ne_bytes()),
        DataType::U8 => out.copy_from_slice(&(w as u8).to_ne_bytes()),
        DataType::U16 => out.copy_from_slice(&(w as u16).to_ne_bytes()),
        DataType::Bool => out[0] = (w != 0) as u8,
        DataType::I32 => out.copy_from_slice(&(w as i32).to_ne_bytes()),
        DataType::U32 => out.copy_from_slice(&(w as u32).to_ne_bytes()),
        DataType::I64 => out.copy_from_slice(&(w as i64).to_ne_bytes()),
        DataType::U64 => out.copy_from_slice(&(w as u64).to_ne_bytes()),
        DataType::F16 => out.copy_from_slice(&f16::from_f64(x).to_ne_bytes()),
        DataType::Bf16 => out.copy_from_slice(&bf16::from_f64(x).to_ne_bytes()),
        DataType::F32 => out.copy_from_slice(&(x as f32).to_ne_bytes()),
        DataType::F64 => out.copy_from_slice(&x.to_ne_bytes()),
    }
}

/// Reads element bytes of `dtype` as f64.
pub fn decode(dtype: DataType, b: &[u8]) -> f64 {
    let a = |n: usize| -> [u8; 8] {
        let mut x = [0u8; 8];
        x[..n].copy_from_slice(&b[..n]);
        x
    };
    match dtype {
        DataType::I8 => b[0] as i8 as f64,
        DataType::U8 | DataType::Bool => b[0] as f64,
        DataType::U16 => u16::from_ne_bytes([b[0], b[1]]) as f64,
        DataType::I32 => i32::from_ne_bytes(a(4)[..4].try_into().unwrap_or_default()) as f64,
        DataType::U32 => u32::from_ne_bytes(a(4)[..4].try_into().unwrap_or_default()) as f64,
        DataType::I64 => i64::from_ne_bytes(a(8)) as f64,
        DataType::U64 => u64::from_ne_bytes(a(8)) as f64,
        DataType::F16 => f16::from_ne_bytes([b[0], b[1]]).to_f64(),
        DataType::Bf16 => bf16::from_ne_bytes([b[0], b[1]]).to_f64(),
        DataType::F32 => f32::from_ne_bytes(a(4)[..4].try_into().unwrap_or_default()) as f64,
        DataType::F64 => f64::from_ne_bytes(a(8)),
    }
}

/// Fills `buf` (elements of `dtype`) with `f(element index)`.
pub fn fill(dtype: DataType, buf: &mut [u8], f: impl Fn(usize) -> f64) {
    for (i, e) in buf.chunks_exact_mut(dtype.size()).enumerate() {
        encode(dtype, f(i), e);
    }
}

/// Counts the elements of `got` that differ from `want(element index)` as encoded in
/// `dtype` (exactly, except averages of floats, which may differ in the last place).
pub fn count_wrong(
    dtype: DataType,
    op: ReduceOp,
    got: &[u8],
    want: impl Fn(usize) -> f64,
) -> usize {
    let es = dtype.size();
    let mut exp = [0u8; 8];
    got.chunks_exact(es)
        .enumerate()
        .filter(|(i, g)| {
            let w = want(*i);
            encode(dtype, w, &mut exp[..es]);
            if *g == &exp[..es] {
                return false;
            }
            if op == ReduceOp::Avg && dtype.is_float() {
                let tol = match dtype {
                    DataType::F16 => 1e-3,
                    DataType::Bf16 => 8e-3,
                    _ => 1e-6,
                };
                // Written so that NaN counts as wrong.
                let err = (decode(dtype, g) - w).abs();
                return err.is_nan() || err > tol * w.abs().max(1.0);
            }
            true
        })
        .count()
}

/// The contents of a reference point-to-point message from `src` to `dst` with `tag`:
/// element `i` (exact in every type but bool, where it is its lowest bit).
fn p2p_value(src: usize, dst: usize, tag: u32, i: usize) -> f64 {
    ((src * 7 + dst * 3 + tag as usize + i % 251) % 256) as f64
}

fn p2p_fill(dtype: DataType, count: usize, src: usize, dst: usize, tag: u32) -> Vec<u64> {
    let bytes = count * dtype.size();
    let mut w = vec![0u64; bytes.div_ceil(8)];
    fill(
        dtype,
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..bytes],
        |i| p2p_value(src, dst, tag, i),
    );
    w
}

fn p2p_wrong(dtype: DataType, got: &[u8], src: usize, dst: usize, tag: u32) -> usize {
    count_wrong(dtype, ReduceOp::Sum, got, |i| p2p_value(src, dst, tag, i))
}

/// The point-to-point reference, run by every rank of `comm` with message lengths `counts`;
/// returns the wrong elements received (calls that fail panic with the case). Every rank:
/// 1. in one [`Communicator::group_p2p`], sends to every other rank first, then receives
///    from each (a send-first exchange, each message larger than the links' buffers for the
///    largest count);
/// 2. sends three tagged messages (u16) and a plain one to the next rank and receives them
///    from the previous one in another order (tags 3, 0, 1, 2): separate calls for counts
///    whose messages (and headers) fit in `buffered` bytes, a group otherwise;
/// 3. rank 0 takes one message (i64, tag 9) from every other rank with
///    [`Communicator::recv_any`], in whatever order they come.
pub fn p2p(comm: &Communicator, counts: &[usize], buffered: usize) -> usize {
    let (r, n) = (comm.rank(), comm.world_size());
    let bytes = |w: &[u64], count: usize, d: DataType| -> Vec<u8> {
        bytemuck::cast_slice::<u64, u8>(w)[..count * d.size()].to_vec()
    };
    let mut wrong = 0;
    for &count in counts {
        let what = |step: &str| format!("rank {r} of {n}, count {count}: {step}");
        // 1. Send-first exchange.
        let f = DataType::F32;
        let sends: Vec<Vec<u8>> = (0..n)
            .map(|p| bytes(&p2p_fill(f, count, r, p, 0), count, f))
            .collect();
        let mut recvs: Vec<Vec<u64>> = (0..n).map(|_| vec![0; (count * 4).div_ceil(8)]).collect();
        {
            let mut ops: Vec<P2pOp<'_>> = (0..n)
                .filter(|&p| p != r)
                .map(|p| P2pOp::Send {
                    peer: p,
                    tag: 0,
                    dtype: f,
                    buf: &sends[p],
                })
                .collect();
            for (p, w) in recvs.iter_mut().enumerate().filter(|(p, _)| *p != r) {
                ops.push(P2pOp::Recv {
                    peer: Some(p),
                    tag: 0,
                    dtype: f,
                    buf: &mut bytemuck::cast_slice_mut::<u64, u8>(w)[..count * 4],
                    from: None,
                });
            }
            comm.group_p2p(&mut ops)
                .unwrap_or_else(|e| panic!("{}: {e}", what("exchange")));
        }
        for (p, w) in recvs.iter().enumerate().filter(|(p, _)| *p != r) {
            wrong += p2p_wrong(f, &bytemuck::cast_slice::<u64, u8>(w)[..count * 4], p, r, 0);
        }
        if n == 1 {
            continue;
        }
        // 2. Tags, received out of order.
        let (next, prev, u) = ((r + 1) % n, (r + n - 1) % n, DataType::U16);
        let tags = [1u32, 2, 3, 0];
        let out: Vec<Vec<u64>> = tags
            .iter()
            .map(|&t| p2p_fill(u, count, r, next, t))
            .collect();
        let order = [2usize, 3, 0, 1]; // tags 3, 0, 1, 2
        let mut got: Vec<Vec<u64>> = tags
            .iter()
            .map(|_| vec![0; (count * 2).div_ceil(8)])
            .collect();
        if (count * 2 + 24) * tags.len() <= buffered {
            for (t, m) in tags.iter().zip(&out) {
                let m = &bytemuck::cast_slice::<u64, u16>(m)[..count];
                comm.send_tagged(m, next, *t)
                    .unwrap_or_else(|e| panic!("{}: {e}", what("send_tagged")));
            }
            for &k in &order {
                let buf = &mut bytemuck::cast_slice_mut::<u64, u16>(&mut got[k])[..count];
                comm.recv_tagged(buf, prev, tags[k])
                    .unwrap_or_else(|e| panic!("{}: {e}", what("recv_tagged")));
            }
        } else {
            let mut ops: Vec<P2pOp<'_>> = tags
                .iter()
                .zip(&out)
                .map(|(t, m)| P2pOp::Send {
                    peer: next,
                    tag: *t,
                    dtype: u,
                    buf: &bytemuck::cast_slice::<u64, u8>(m)[..count * 2],
                })
                .collect();
            let mut slots: Vec<Option<&mut Vec<u64>>> = got.iter_mut().map(Some).collect();
            for &k in &order {
                let w = slots[k].take().expect("each once");
                ops.push(P2pOp::Recv {
                    peer: Some(prev),
                    tag: tags[k],
                    dtype: u,
                    buf: &mut bytemuck::cast_slice_mut::<u64, u8>(w)[..count * 2],
                    from: None,
                });
            }
            comm.group_p2p(&mut ops)
                .unwrap_or_else(|e| panic!("{}: {e}", what("tagged group")));
        }
        for (k, w) in got.iter().enumerate() {
            wrong += p2p_wrong(
                u,
                &bytemuck::cast_slice::<u64, u8>(w)[..count * 2],
                prev,
                r,
                tags[k],
            );
        }
        // 3. From any source, into rank 0.
        let i = DataType::I64;
        if r == 0 {
            let mut seen = vec![false; n];
            for _ in 1..n {
                let mut buf = vec![0i64; count];
                let src = comm
                    .recv_any(&mut buf, 9)
                    .unwrap_or_else(|e| panic!("{}: {e}", what("recv_any")));
                assert!(
                    src != 0 && !seen[src],
                    "{}: source {src} again",
                    what("recv_any")
                );
                seen[src] = true;
                wrong += p2p_wrong(i, bytemuck::cast_slice(&buf), src, 0, 9);
            }
        } else {
            let m = p2p_fill(i, count, r, 0, 9);
            let m: &[i64] = &bytemuck::cast_slice(&m)[..count];
            // Large messages in a group of one: sent as the receiver reads.
            comm.send_tagged(m, 0, 9)
                .unwrap_or_else(|e| panic!("{}: {e}", what("send to recv_any")));
        }
        comm.barrier()
            .unwrap_or_else(|e| panic!("{}: {e}", what("barrier")));
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_everywhere() {
        for d in DataType::ALL {
            for op in ops(d) {
                for n in [1, 2, 3, 8] {
                    let want = |g: usize| reduced(d, op, n, g);
                    let mut buf = vec![0u8; 64 * d.size()];
                    fill(d, &mut buf, want);
                    assert_eq!(count_wrong(d, op, &buf, want), 0, "{d} {op} {n}");
                    buf[d.size() - 1] ^= 0x40;
                    assert_eq!(
                        count_wrong(d, op, &buf, want),
                        1,
                        "a flipped bit is caught: {d} {op} {n}"
                    );
                }
            }
        }
    }
}
