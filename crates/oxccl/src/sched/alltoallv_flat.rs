//! Flat all_to_allv (an all_to_all whose blocks may differ in size): every rank sends each
//! peer its block and receives each peer's, all at once, in one step (its own block copied
//! locally). Each link carries one block each way; a rank sends `Σ` of its blocks for others.
//! Unlike the pairwise all_to_all's `n-1` steps, no rank waits for a peer's block before
//! sending the next: with blocks of different sizes, a step of the pairwise exchange would
//! last as long as its largest block.

use super::{blocks, Blocks, Coll, Schedule};

/// The flat all_to_allv schedule for `c` (its blocks: [`Coll::blocks`]).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    blocks::flat(c)
}

/// Rank `rank`'s blocks in an all_to_allv where rank `r` sends `lens(r, p)` bytes to rank
/// `p`: blocks in rank order in both input and output.
pub(crate) fn blocks(rank: usize, n: usize, lens: impl Fn(usize, usize) -> usize) -> Blocks {
    let send: Vec<Option<usize>> = (0..n).map(|p| Some(lens(rank, p))).collect();
    let recv: Vec<Option<usize>> = (0..n).map(|p| Some(lens(p, rank))).collect();
    Blocks::by_rank(&send, &recv)
}

#[cfg(test)]
mod tests {
    use crate::sched::sim;
    use crate::sched::CollKind;

    #[test]
    fn every_block_reaches_its_rank() {
        for n in [1, 2, 3, 4, 7] {
            sim::check_blocks(CollKind::AllToAllV, n, |r| super::blocks(r, n, |_, _| 8));
            sim::check_blocks(CollKind::AllToAllV, n, |r| {
                super::blocks(r, n, |a, b| 4 * ((a * 3 + b) % 4))
            });
        }
    }
}
