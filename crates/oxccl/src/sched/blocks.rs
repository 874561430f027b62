//! The blocks of the collectives whose blocks may differ in size (gather, scatter,
//! all_to_allv), and the flat schedule they share: every block goes straight from the rank
//! that has it to the rank that wants it, the k-th block of each ordered pair of ranks in step
//! k (one step unless a rank passes several blocks for one peer). A pair that exchanges blocks
//! in one direction only also exchanges an empty transfer in the other, in the first step: so
//! no rank completes the call before each of its peers has begun it (a gather's root tells
//! each rank it has begun, each rank tells a scatter's root).

use super::{Buf, BufRange, Coll, Combine, Local, Schedule, Step, Xfer};

/// What one rank sends and receives in a collective made of blocks: per rank, in order, the
/// `(offset, length)` in bytes of each block of this rank's input that goes there, and of
/// each block of its output that comes from there. This rank's own entries pair up, in order:
/// each block it sends itself is copied into the block it receives from itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Blocks {
    /// Per rank: the input blocks sent there.
    pub send: Vec<Vec<(usize, usize)>>,
    /// Per rank: the output blocks received from there.
    pub recv: Vec<Vec<(usize, usize)>>,
}

impl Blocks {
    /// No blocks, for a world of `n` ranks.
    pub(crate) fn new(n: usize) -> Self {
        Blocks {
            send: vec![Vec::new(); n],
            recv: vec![Vec::new(); n],
        }
    }

    /// Blocks laid end to end by rank: `send[p]` (bytes) of the input for each rank `p`
    /// (`None`: nothing for `p`, not even an empty block), and the same for the output.
    pub(crate) fn by_rank(send: &[Option<usize>], recv: &[Option<usize>]) -> Self {
        let lay = |lens: &[Option<usize>]| {
            let mut off = 0;
            lens.iter()
                .map(|l| match *l {
                    Some(len) => {
                        off += len;
                        vec![(off - len, len)]
                    }
                    None => Vec::new(),
                })
                .collect()
        };
        Blocks {
            send: lay(send),
            recv: lay(recv),
        }
    }

    /// Bytes of the input the blocks cover (the end of the last one).
    pub(crate) fn input_bytes(&self) -> usize {
        end(&self.send)
    }

    /// Bytes of the output the blocks cover.
    pub(crate) fn output_bytes(&self) -> usize {
        end(&self.recv)
    }
}

fn end(v: &[Vec<(usize, usize)>]) -> usize {
    v.iter().flatten().map(|&(o, l)| o + l).max().unwrap_or(0)
}

/// The flat schedule of `c`'s blocks ([`Coll::blocks`]; none: an empty schedule).
pub(crate) fn flat(c: &Coll) -> Schedule {
    let mut s = Schedule::new("flat");
    let Some(b) = c.blocks.as_deref() else {
        return s;
    };
    let (me, n) = (c.rank, c.nranks);
    let none = Vec::new();
    let send = |p: usize| b.send.get(p).unwrap_or(&none);
    let recv = |p: usize| b.recv.get(p).unwrap_or(&none);
    let copies: Vec<Local> = send(me)
        .iter()
        .zip(recv(me))
        .map(|(&(so, sl), &(ro, _))| Local::Copy {
            src: BufRange::new(Buf::Input, so, sl),
            dst: BufRange::new(Buf::Output, ro, sl),
        })
        .filter(|l| !l.is_empty())
        .collect();
    let steps = (0..n)
        .filter(|&p| p != me)
        .map(|p| send(p).len().max(recv(p).len()))
        .max()
        .unwrap_or(0);
    for k in 0..steps {
        let mut step = Step::default();
        for p in (0..n).filter(|&p| p != me) {
            let (sp, rp) = (send(p), recv(p));
            if let Some(&(off, len)) = sp.get(k) {
                step.xfers.push(Xfer::Send {
                    peer: p,
                    src: BufRange::new(Buf::Input, off, len),
                });
            } else if k == 0 && sp.is_empty() && !rp.is_empty() {
                // The word that this rank has begun, to a peer that only sends to it.
                step.xfers.push(Xfer::Send {
                    peer: p,
                    src: BufRange::new(Buf::Input, 0, 0),
                });
            }
            if let Some(&(off, len)) = rp.get(k) {
                step.xfers.push(Xfer::Recv {
                    peer: p,
                    dst: BufRange::new(Buf::Output, off, len),
                    combine: Combine::Store,
                });
            } else if k == 0 && rp.is_empty() && !sp.is_empty() {
                // The word that the peer has begun, from a peer this rank only sends to.
                step.xfers.push(Xfer::Recv {
                    peer: p,
                    dst: BufRange::new(Buf::Output, 0, 0),
                    combine: Combine::Store,
                });
            }
        }
        if !step.xfers.is_empty() {
            s.steps.push(step);
        }
    }
    // This rank's own blocks, copied while the peers' are on their way.
    match s.steps.first_mut() {
        Some(first) => first.before = copies,
        None => {
            for l in copies {
                s.push_local(l);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_way_pairs_get_an_empty_word_back() {
        // Rank 1 of 3 sends 8 bytes to rank 0 and nothing else (a gather's sender).
        let b = Blocks::by_rank(&[Some(8), None, None], &[None, None, None]);
        let c = crate::sched::sim::coll_with_blocks(crate::sched::CollKind::Gather, 1, 3, b);
        let s = flat(&c);
        assert_eq!(s.steps.len(), 1);
        assert_eq!(
            s.steps[0].xfers,
            vec![
                Xfer::Send {
                    peer: 0,
                    src: BufRange::new(Buf::Input, 0, 8)
                },
                Xfer::Recv {
                    peer: 0,
                    dst: BufRange::new(Buf::Output, 0, 0),
                    combine: Combine::Store
                }
            ]
        );
        s.validate(1).unwrap();
    }

    #[test]
    fn several_blocks_for_one_peer_go_in_steps() {
        // Rank 0 of 2 sends rank 1 two blocks and receives three from it.
        let b = Blocks {
            send: vec![vec![], vec![(0, 4), (4, 4)]],
            recv: vec![vec![], vec![(0, 4), (4, 4), (8, 4)]],
        };
        let c = crate::sched::sim::coll_with_blocks(crate::sched::CollKind::AllToAllV, 0, 2, b);
        let s = flat(&c);
        assert_eq!(s.steps.len(), 3);
        assert_eq!(s.steps[0].xfers.len(), 2);
        assert_eq!(s.steps[2].xfers.len(), 1);
        s.validate(0).unwrap();
    }

    #[test]
    fn several_blocks_per_pair_arrive_in_order() {
        use crate::sched::{sim, CollKind};
        // Rank a sends rank b m(a, b) blocks, the k-th of sz(a, b, k) bytes.
        let m = |a: usize, b: usize| (a + 2 * b) % 3;
        let sz = |a: usize, b: usize, k: usize| 4 * ((a + b + k) % 3);
        for n in [1, 2, 3, 5] {
            sim::check_blocks(CollKind::AllToAllV, n, |r| {
                let mut b = Blocks::new(n);
                let (mut i, mut o) = (0, 0);
                for p in 0..n {
                    for k in 0..m(r, p) {
                        b.send[p].push((i, sz(r, p, k)));
                        i += sz(r, p, k);
                    }
                    for k in 0..m(p, r) {
                        b.recv[p].push((o, sz(p, r, k)));
                        o += sz(p, r, k);
                    }
                }
                b
            });
        }
    }
}
