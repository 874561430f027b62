//! Every rank starts from rank 0's initial weights: rank 0 initializes, `broadcast` copies.
//!
//! ```sh
//! cargo build --release -p oxccl-examples -p oxccl-cli
//! target/release/oxccl run -n 4 -- target/release/broadcast_weights
//! ```

use oxccl::{Communicator, ReduceOp};

fn main() -> oxccl::Result<()> {
    let comm = Communicator::from_env()?;
    let (rank, n) = (comm.rank(), comm.world_size());

    // Each rank would draw different random weights; only rank 0's count.
    let mut weights: Vec<f32> = (0..1_000_000)
        .map(|i| ((i * 7919 + rank * 104_729) % 1000) as f32 * 1e-3)
        .collect();
    comm.broadcast_in_place(&mut weights, 0)?;

    // Check: everyone now holds rank 0's weights (compare a checksum's min and max).
    let sum: f64 = weights.iter().map(|&w| w as f64).sum();
    let mut lo = [sum];
    let mut hi = [sum];
    comm.all_reduce_in_place(&mut lo, ReduceOp::Min)?;
    comm.all_reduce_in_place(&mut hi, ReduceOp::Max)?;
    assert_eq!(lo, hi, "ranks disagree after broadcast");
    let expect: f64 = (0..1_000_000usize)
        .map(|i| ((i * 7919) % 1000) as f32 as f64 * 1e-3)
        .map(|w| w as f32 as f64)
        .sum();
    assert!(
        (sum - expect).abs() < 1e-6 * expect.abs(),
        "{sum} vs {expect}"
    );
    println!("rank {rank}/{n}: weights broadcast from rank 0, checksum {sum:.3}");
    Ok(())
}
