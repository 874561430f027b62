//! Tree all-reduce for small messages, in as few network round trips as possible:
//!
//! 1. inside each host, a binomial tree reduces to the host's leader (its lowest rank):
//!    in round `k` local index `j` with bit `k` set (and no lower bit) sends its partial
//!    result to `j - 2^k`;
//! 2. the `H` leaders all-reduce by recursive doubling: in round `k` leader `h` exchanges
//!    its whole partial result with leader `h xor 2^k` and both combine (when `H` is not a
//!    power of two, the leaders above the largest power `P ≤ H` first hand their value to
//!    leader `h - P` and get the result back at the end);
//! 3. inside each host, a binomial tree broadcasts from the leader.
//!
//! `⌈log2 H⌉` network steps (two more if `H` is not a power of two) and `2⌈log2 L⌉`
//! shared-memory steps, each moving the whole buffer: the choice for latency-bound sizes.
//! Every combination is of the same two operands on both sides of an exchange, and the
//! reduction ops are commutative, so every rank ends with the same bits.
//! Without a topology every rank counts as one host (a binomial reduce and broadcast).

use super::placement::levels;
use super::{Buf, BufRange, Coll, Combine, Local, ReduceOp, Schedule, Xfer};

/// The tree all-reduce schedule for `c`.
pub(crate) fn schedule(c: &Coll) -> Schedule {
    let all = c.count * c.dtype.size();
    let out = BufRange::new(Buf::Output, 0, all);
    let scr = BufRange::new(Buf::Scratch, 0, all);
    let mut s = Schedule::new("tree");
    s.push_local(Local::Copy {
        src: BufRange::new(Buf::Input, 0, all),
        dst: out,
    });
    // Local ranks and host leaders.
    let flat: Vec<usize> = (0..c.nranks).collect();
    let (local, j, leaders): (&[usize], usize, Vec<usize>) = match levels(c) {
        Some((local, j, t)) => (local, j, t.hosts.iter().map(|h| h[0]).collect()),
        None => (&flat, c.rank, vec![0]),
    };
    let l = local.len();

    // 1. Binomial reduce to local index 0.
    let mut k = 1;
    while k < l {
        if j % (2 * k) == k {
            s.push_xfers([Xfer::Send {
                peer: local[j - k],
                src: out,
            }]);
        } else if j % (2 * k) == 0 && j + k < l {
            s.push_xfers([Xfer::Recv {
                peer: local[j + k],
                dst: out,
                combine: Combine::Reduce { with: out },
            }]);
        }
        k *= 2;
    }

    if j == 0 {
        // 2. Recursive doubling among leaders; the result alternates between the output and
        //    the scratch (a buffer cannot be sent and combined into in one step).
        let hn = leaders.len();
        let h = leaders.iter().position(|&r| r == c.rank).unwrap_or(0);
        let p = if hn == 0 { 1 } else { 1 << hn.ilog2() };
        if h >= p {
            s.push_xfers([Xfer::Send {
                peer: leaders[h - p],
                src: out,
            }]);
            s.push_xfers([Xfer::Recv {
                peer: leaders[h - p],
                dst: out,
                combine: Combine::Store,
            }]);
        } else {
            if h + p < hn {
                s.push_xfers([Xfer::Recv {
                    peer: leaders[h + p],
                    dst: out,
                    combine: Combine::Reduce { with: out },
                }]);
            }
            let mut cur = out;
            let mut k = 1;
            while k < p {
                let partner = leaders[h ^ k];
                let next = if cur == out { scr } else { out };
                s.push_xfers([
                    Xfer::Send {
                        peer: partner,
                        src: cur,
                    },
                    Xfer::Recv {
                        peer: partner,
                        dst: next,
                        combine: Combine::Reduce { with: cur },
                    },
                ]);
                cur = next;
                k *= 2;
            }
            if cur != out {
                s.push_local(Local::Copy { src: cur, dst: out });
            }
            if c.op == ReduceOp::Avg {
                s.push_local(Local::DivideByRanks(out));
            }
            if h + p < hn {
                s.push_xfers([Xfer::Send {
                    peer: leaders[h + p],
                    src: out,
                }]);
            }
        }
        if p > 1 {
            s.scratch_bytes = all;
        }
    }

    // 3. Binomial broadcast from local index 0.
    let mut k = if l > 1 { 1 << (l - 1).ilog2() } else { 0 };
    while k >= 1 {
        if j % (2 * k) == 0 && j + k < l {
            s.push_xfers([Xfer::Send {
                peer: local[j + k],
                src: out,
            }]);
        } else if j % (2 * k) == k {
            s.push_xfers([Xfer::Recv {
                peer: local[j - k],
                dst: out,
                combine: Combine::Store,
            }]);
        }
        k /= 2;
    }
    s
}
