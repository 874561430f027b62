//! Halving-doubling all-reduce (Rabenseifner's algorithm, as in MPICH and Gloo): a
//! reduce-scatter by recursive halving, then an all-gather by recursive doubling.
//!
//! Let `P` be the largest power of two `≤ n`. The `P` participants are numbered
//! `q = 0 .. P-1` and the buffer is split into `P` blocks ([`block`]: by elements, the first
//! `count mod P` blocks one element longer, so any count works, including counts below `P`).
//!
//! 1. Halving, steps `k = 0 .. log2 P - 1`: participant `q` holds a range of blocks (all `P`
//!    at first) and exchanges with participant `q xor 2^k`, which holds the same range: it
//!    sends the half the partner keeps (`q` keeps the lower half where bit `k` of `q` is
//!    clear, the upper half where it is set) and receives the half it keeps, storing
//!    `own ⊕ incoming` in the output (step 0 reads its own half from the input). After
//!    `log2 P` steps it holds one block, reduced over all ranks; for `avg` it divides that
//!    block by `n` here, once.
//! 2. Doubling, steps `k = log2 P - 1 .. 0` (the same partners in reverse order): send the
//!    range it holds, store the partner's, so the range doubles each step until it is the
//!    whole buffer.
//!
//! `2·log2 P` steps; in each phase a participant sends `S/2 + S/4 + ... + S/P`, so
//! `2(P-1)/P · S` in all: the ring's bytes on the wire with logarithmic instead of linear
//! latency.
//!
//! When `n` is not a power of two, the `r = n - P` extra ranks are paired with participants
//! as in MPICH: among the first `2r` positions, odd position `2i+1` sends its whole input to
//! position `2i`, which reduces it into its own before step 0 and sends the whole result
//! back after the last doubling step; the odd positions sit out in between. Participant `q`
//! is position `2q` for `q < r`, else position `q + r`. That adds 2 steps (the pairs'
//! ranks move `S` more each way) to `2·log2 P`.
//!
//! Every element is reduced by exactly one rank (the owner of its block, after the halving)
//! and then only copied, so every rank ends with the same bits whatever the op. The order in
//! which the ranks' values are combined is neither rank order nor the ring's, so the bits may
//! differ from other algorithms' (it is not rank-ordered: `OXCCL_DETERMINISTIC=1` never
//! picks it).
//!
//! "Position" is the place in host order ([`placement::Ring`], rank order without a
//! topology): the largest exchanges (step 0, `S/2` each way) and the pairing of extra ranks
//! are between neighbouring positions, on one host where hosts have several ranks. With `H`
//! hosts of `L` ranks each (powers of two), the first `log2 L` steps of each phase stay
//! inside the hosts and each host's network link carries `2(H-1)/H · S` each way, as the
//! hierarchical all-reduce's.

use super::placement::{self, Ring};
use super::{block, Buf, BufRange, Coll, Combine, Local, ReduceOp, Schedule, Xfer};

/// The halving-doubling all-reduce schedule for `c`.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let ring: Ring = placement::Ring::of(c);
    let (n, pos, es) = (c.nranks, ring.pos, c.dtype.size());
    let all = c.count * es;
    let input = BufRange::new(Buf::Input, 0, all);
    let out = BufRange::new(Buf::Output, 0, all);
    let mut s = Schedule::new("hd");
    let p = if n == 0 { 1 } else { 1 << n.ilog2() };
    let extra = n - p;

    // An extra rank: hand the input to the participant at the previous position, get the
    // result back.
    if pos < 2 * extra && pos % 2 == 1 {
        let partner = ring.rank_at(pos - 1);
        s.push_xfers([Xfer::Send {
            peer: partner,
            src: input,
        }]);
        s.push_xfers([Xfer::Recv {
            peer: partner,
            dst: out,
            combine: Combine::Store,
        }]);
        return s;
    }
    let q = if pos < 2 * extra {
        pos / 2
    } else {
        pos - extra
    };
    // The rank of participant `i`.
    let rank_of = |i: usize| ring.rank_at(if i < extra { 2 * i } else { i + extra });
    // Blocks `lo .. hi` of `P` as a region of `buf`.
    let blocks = |buf, lo: usize, hi: usize| {
        let (start, end) = (block(c.count, p, lo).0, block(c.count, p, hi).0);
        BufRange::new(buf, start * es, (end - start) * es)
    };
    let partner_extra = (pos < 2 * extra).then(|| ring.rank_at(pos + 1));

    // Where this rank's partial result is: the input until something has been reduced into
    // the output.
    let mut cur = Buf::Input;
    if let Some(x) = partner_extra {
        s.push_xfers([Xfer::Recv {
            peer: x,
            dst: out,
            combine: Combine::Reduce { with: input },
        }]);
        cur = Buf::Output;
    }

    // 1. Recursive halving. `ranges[k]`: the blocks held before step `k`.
    let (mut lo, mut hi) = (0, p);
    let mut ranges = Vec::new();
    let mut mask = 1;
    while mask < p {
        let peer = rank_of(q ^ mask);
        let mid = lo + (hi - lo) / 2;
        let (keep, give) = if q & mask == 0 {
            ((lo, mid), (mid, hi))
        } else {
            ((mid, hi), (lo, mid))
        };
        ranges.push((lo, hi));
        s.push_xfers([
            Xfer::Send {
                peer,
                src: blocks(cur, give.0, give.1),
            },
            Xfer::Recv {
                peer,
                dst: blocks(Buf::Output, keep.0, keep.1),
                combine: Combine::Reduce {
                    with: blocks(cur, keep.0, keep.1),
                },
            },
        ]);
        cur = Buf::Output;
        (lo, hi) = keep;
        mask <<= 1;
    }
    if cur == Buf::Input {
        // One rank: nothing to combine.
        s.push_local(Local::Copy {
            src: input,
            dst: out,
        });
        return s;
    }
    if c.op == ReduceOp::Avg {
        // The last halving step received this block (when it is not empty), so this runs
        // after the block is complete.
        s.push_local(Local::DivideByRanks(blocks(Buf::Output, lo, hi)));
    }

    // 2. Recursive doubling, the same partners in reverse order.
    for (k, &(plo, phi)) in ranges.iter().enumerate().rev() {
        let peer = rank_of(q ^ (1 << k));
        let theirs = if lo == plo { (hi, phi) } else { (plo, lo) };
        s.push_xfers([
            Xfer::Send {
                peer,
                src: blocks(Buf::Output, lo, hi),
            },
            Xfer::Recv {
                peer,
                dst: blocks(Buf::Output, theirs.0, theirs.1),
                combine: Combine::Store,
            },
        ]);
        (lo, hi) = (plo, phi);
    }
    if let Some(x) = partner_extra {
        s.push_xfers([Xfer::Send { peer: x, src: out }]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::dtype::DataType;
    use crate::comm::check;
    use crate::sched::sim::{make_bufs, run};
    use crate::sched::{Algo, CollKind};

    fn colls(n: usize, count: usize, dtype: DataType, op: ReduceOp) -> Vec<Coll> {
        (0..n)
            .map(|rank| Coll {
                kind: CollKind::AllReduce,
                rank,
                nranks: n,
                count,
                dtype,
                op,
                root: 0,
                chunk_bytes: 24,
                topo: None,
                blocks: None,
            })
            .collect()
    }

    /// Every rank's output after the halving-doubling all-reduce of `input(rank)`.
    fn outputs(
        n: usize,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        input: impl Fn(usize) -> Vec<u8>,
    ) -> Vec<Vec<u8>> {
        let cs = colls(n, count, dtype, op);
        let mut bufs = make_bufs(n, input, |_| vec![0x55; count * dtype.size()]);
        run(Algo::HalvingDoubling, &cs, &mut bufs);
        bufs.into_iter().map(|b| b.output).collect()
    }

    fn counts(n: usize) -> [usize; 7] {
        [0, 1, 2, 7, n - 1, n + 1, 1000]
    }

    fn int_val(rank: usize, i: usize) -> i32 {
        ((rank * 7 + i * 3) % 11) as i32 - 5
    }

    /// Signed powers of two: sums and products of up to 9 are exact in f32, so any order of
    /// combination gives the reference's bits.
    fn exact_f32(rank: usize, i: usize) -> f32 {
        [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 4.0][(rank * 5 + i * 3) % 7]
    }

    fn fold<T: Copy>(n: usize, v: impl Fn(usize) -> T, f: impl Fn(T, T) -> T) -> T {
        (1..n).fold(v(0), |a, r| f(a, v(r)))
    }

    /// How a reference combines two values for an op.
    type Fold<T> = fn(T, T) -> T;

    /// Every op on `dtype` over the inputs `val(rank, i)`, against a fold in rank order with
    /// `combine(op)` (avg: the sum, then `avg(sum, n)`), bit for bit on every rank.
    fn matches_reference<T: bytemuck::Pod>(
        dtype: DataType,
        val: fn(usize, usize) -> T,
        combine: fn(ReduceOp) -> Fold<T>,
        avg: fn(T, usize) -> T,
    ) {
        for n in 1..=9usize {
            for count in counts(n) {
                for op in ReduceOp::ALL {
                    let outs = outputs(n, count, dtype, op, |r| {
                        let v: Vec<T> = (0..count).map(|i| val(r, i)).collect();
                        bytemuck::cast_slice(&v).to_vec()
                    });
                    let want: Vec<T> = (0..count)
                        .map(|i| {
                            let folded = fold(n, |r| val(r, i), combine(op));
                            if op == ReduceOp::Avg {
                                avg(folded, n)
                            } else {
                                folded
                            }
                        })
                        .collect();
                    for (r, o) in outs.iter().enumerate() {
                        assert_eq!(
                            o.as_slice(),
                            bytemuck::cast_slice::<T, u8>(&want),
                            "{dtype} n={n} count={count} op={op} rank={r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn i32_matches_reference() {
        matches_reference(
            DataType::I32,
            int_val,
            |op| match op {
                ReduceOp::Sum | ReduceOp::Avg => i32::wrapping_add,
                ReduceOp::Prod => i32::wrapping_mul,
                ReduceOp::Min => Ord::min,
                ReduceOp::Max => Ord::max,
                ReduceOp::BAnd => |a, b| a & b,
                ReduceOp::BOr => |a, b| a | b,
                ReduceOp::BXor => |a, b| a ^ b,
                ReduceOp::PreMulSum(_) => unreachable!("not in ReduceOp::ALL"),
            },
            |s, n| s / n as i32,
        );
    }

    #[test]
    fn f32_matches_reference() {
        matches_reference(
            DataType::F32,
            exact_f32,
            |op| match op {
                ReduceOp::Sum | ReduceOp::Avg => |a, b| a + b,
                ReduceOp::Prod => |a, b| a * b,
                ReduceOp::Min => f32::min,
                ReduceOp::Max => f32::max,
                _ => unreachable!("not in ReduceOp::ALL"),
            },
            |s, n| s / n as f32,
        );
    }

    /// Values whose sums and products round: every rank must still get the same bits (each
    /// element reduced once, by its block's owner, then copied), close to the exact result.
    #[test]
    fn rounding_floats_give_identical_bits_on_every_rank() {
        let hash = |r: usize, i: usize| {
            let mut x = ((r * 1_000_003 + i) as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D);
            x ^= x >> 29;
            (x % 1_000_000) as f64 / 1e6 // [0, 1)
        };
        // Near 1 for products, so that they neither overflow nor vanish.
        let val = |op, r, i| match op {
            ReduceOp::Prod => 0.75 + 0.5 * hash(r, i),
            _ => 200.0 * hash(r, i) - 100.0,
        };
        for n in 1..=9usize {
            for count in counts(n) {
                for op in ReduceOp::ALL {
                    let exact: Vec<f64> = (0..count)
                        .map(|i| {
                            let v = |r| val(op, r, i);
                            match op {
                                ReduceOp::Sum => fold(n, v, |a, b| a + b),
                                ReduceOp::Avg => fold(n, v, |a, b| a + b) / n as f64,
                                ReduceOp::Prod => fold(n, v, |a, b| a * b),
                                ReduceOp::Min => fold(n, v, f64::min),
                                ReduceOp::Max => fold(n, v, f64::max),
                                _ => unreachable!("not in ReduceOp::ALL"),
                            }
                        })
                        .collect();
                    let f32s = outputs(n, count, DataType::F32, op, |r| {
                        let v: Vec<f32> = (0..count).map(|i| val(op, r, i) as f32).collect();
                        bytemuck::cast_slice(&v).to_vec()
                    });
                    let f64s = outputs(n, count, DataType::F64, op, |r| {
                        let v: Vec<f64> = (0..count).map(|i| val(op, r, i)).collect();
                        bytemuck::cast_slice(&v).to_vec()
                    });
                    for (dtype, outs, tol) in
                        [(DataType::F32, &f32s, 1e-4), (DataType::F64, &f64s, 1e-12)]
                    {
                        for (r, o) in outs.iter().enumerate() {
                            assert!(
                                o == &outs[0],
                                "{dtype} n={n} count={count} op={op}: rank {r}'s bits differ \
                                 from rank 0's"
                            );
                        }
                        for (i, e) in outs[0].chunks_exact(dtype.size()).enumerate() {
                            let got = check::decode(dtype, e);
                            let scale = exact[i].abs().max(1.0);
                            assert!(
                                (got - exact[i]).abs() <= tol * scale * n as f64,
                                "{dtype} n={n} count={count} op={op} element {i}: {got} vs {}",
                                exact[i]
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every element type, through `check`'s reference values (exact in every type).
    #[test]
    fn every_dtype_matches_check_reference() {
        for n in [2usize, 3, 5, 6, 8] {
            for count in [1usize, 13, 100] {
                for dtype in DataType::ALL {
                    // (premul_sum scales inputs before the schedule: the communicator's part.)
                    let ops = check::ops(dtype);
                    for op in ops.into_iter().filter(|o| o.kernel() == *o) {
                        let es = dtype.size();
                        let outs = outputs(n, count, dtype, op, |r| {
                            let mut v = vec![0u8; count * es];
                            check::fill(dtype, &mut v, |g| check::value(op, r, g) as f64);
                            v
                        });
                        for (r, o) in outs.iter().enumerate() {
                            let wrong = check::count_wrong(dtype, op, o, |g| {
                                check::reduced(dtype, op, n, g)
                            });
                            assert_eq!(wrong, 0, "{dtype} {op} n={n} count={count} rank={r}");
                            assert!(o == &outs[0], "{dtype} {op} n={n}: rank {r} differs");
                        }
                    }
                }
            }
        }
    }

    /// Steps and bytes on the wire, as the module documentation says.
    #[test]
    fn steps_and_bytes_on_the_wire() {
        let count = 4800; // divisible by every P here
        let size = count * 8;
        let sched = |n: usize, rank: usize| {
            let c = colls(n, count, DataType::I64, ReduceOp::Sum).swap_remove(rank);
            Algo::HalvingDoubling.schedule(&c)
        };
        for n in [2usize, 4, 8] {
            let lg = n.ilog2() as usize;
            for rank in 0..n {
                let s = sched(n, rank);
                assert_eq!(s.steps.len(), 2 * lg, "n={n} rank={rank}");
                assert_eq!(s.bytes_sent(), 2 * (n - 1) * size / n, "n={n} rank={rank}");
                assert_eq!(s.scratch_bytes, 0);
            }
        }
        // 6 ranks: P = 4; ranks 1 and 3 hand their input to 0 and 2 and get the result back.
        let two_p = 2 * 3 * size / 4;
        for (rank, steps, bytes) in [
            (0, 6, two_p + size),
            (1, 2, size),
            (2, 6, two_p + size),
            (3, 2, size),
            (4, 4, two_p),
            (5, 4, two_p),
        ] {
            let s = sched(6, rank);
            assert_eq!(
                (s.steps.len(), s.bytes_sent()),
                (steps, bytes),
                "n=6 rank={rank}"
            );
        }
        // Each element is combined exactly once per contribution: the reducing receives of
        // all ranks together cover the buffer n-1 times, as few as an all-reduce can.
        for n in 1..=9usize {
            let reduced: usize = (0..n)
                .flat_map(|r| sched(n, r).steps)
                .flat_map(|s| s.xfers)
                .map(|x| match x {
                    Xfer::Recv {
                        dst,
                        combine: Combine::Reduce { .. },
                        ..
                    } => dst.len,
                    _ => 0,
                })
                .sum();
            assert_eq!(reduced, (n - 1) * size, "n={n}");
        }
        // One rank: a copy.
        let s = sched(1, 0);
        assert_eq!(s.bytes_sent(), 0);
        assert_eq!(s.steps.len(), 1);
    }
}
