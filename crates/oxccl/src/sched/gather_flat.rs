//! Flat gather: every rank sends its block straight to the root, all at once; the root
//! receives each into its place in its output (its own block copied locally) and sends each
//! rank an empty transfer, the word that it has begun, so that no rank completes the gather
//! before the root has begun it. One step; the root receives `Σ` of the others' blocks.

use super::{blocks, Blocks, Coll, Schedule};

/// The flat gather schedule for `c` (its blocks: [`Coll::blocks`]).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    blocks::flat(c)
}

/// Rank `rank`'s blocks in a gather to `root` of `lens[r]` bytes from each rank `r`: the
/// root's output holds every rank's block in rank order; each rank's input is its block.
pub(crate) fn blocks(rank: usize, root: usize, lens: &[usize]) -> Blocks {
    let n = lens.len();
    let mut send = vec![None; n];
    send[root] = Some(lens[rank]);
    let recv: Vec<Option<usize>> = if rank == root {
        lens.iter().map(|&l| Some(l)).collect()
    } else {
        vec![None; n]
    };
    Blocks::by_rank(&send, &recv)
}

#[cfg(test)]
mod tests {
    use crate::sched::sim;
    use crate::sched::CollKind;

    #[test]
    fn gathers_every_block_to_the_root() {
        for n in [1, 2, 3, 4, 7] {
            for root in [0, n / 2, n - 1] {
                for lens in [vec![8; n], (0..n).map(|r| 4 * (r % 3)).collect()] {
                    sim::check_blocks(CollKind::Gather, n, |r| super::blocks(r, root, &lens));
                }
            }
        }
    }
}
