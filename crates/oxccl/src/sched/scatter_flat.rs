//! Flat scatter: the root sends every rank its block straight from its input, all at once
//! (its own block copied locally); each rank receives its block and sends the root an empty
//! transfer, the word that it has begun, so that the root does not complete the scatter
//! before every rank has begun it. One step; the root sends `Σ` of the others' blocks.

use super::{blocks, Blocks, Coll, Schedule};

/// The flat scatter schedule for `c` (its blocks: [`Coll::blocks`]).
pub(crate) fn schedule(c: &Coll) -> Schedule {
    blocks::flat(c)
}

/// Rank `rank`'s blocks in a scatter from `root` of `lens[r]` bytes to each rank `r`: the
/// root's input holds every rank's block in rank order; each rank's output is its block.
pub(crate) fn blocks(rank: usize, root: usize, lens: &[usize]) -> Blocks {
    let n = lens.len();
    let mut recv = vec![None; n];
    recv[root] = Some(lens[rank]);
    let send: Vec<Option<usize>> = if rank == root {
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
    fn scatters_every_block_from_the_root() {
        for n in [1, 2, 3, 4, 7] {
            for root in [0, n / 2, n - 1] {
                for lens in [vec![8; n], (0..n).map(|r| 4 * (r % 3)).collect()] {
                    sim::check_blocks(CollKind::Scatter, n, |r| super::blocks(r, root, &lens));
                }
            }
        }
    }
}
