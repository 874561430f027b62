//! A sharded optimizer (ZeRO stage 1/2 style): every rank computes the full gradient of its
//! data, `reduce_scatter(Sum)` leaves each rank the summed gradient of its 1/n shard of the
//! parameters, each rank updates only its shard (and keeps momentum only for it), and
//! `all_gather` reassembles the full parameters for the next step.
//!
//! ```sh
//! cargo build --release -p oxccl-examples -p oxccl-cli
//! target/release/oxccl run -n 4 -- target/release/sharded_optimizer
//! ```

use oxccl::{Communicator, ReduceOp};

fn main() -> oxccl::Result<()> {
    let comm = Communicator::from_env()?;
    let (rank, n) = (comm.rank(), comm.world_size());

    // Minimize f(p) = sum_i c_i (p_i - t_i)^2 over data split among ranks: rank r's part of
    // the objective has weights c_i(r) = 1 + (i + r) % 3, so every rank has a different
    // gradient but the optimum is t for all.
    let params_len = 10_000 * n; // divisible by n: equal shards
    let shard = params_len / n;
    let target: Vec<f32> = (0..params_len).map(|i| (i % 97) as f32 * 0.01).collect();
    let mut params = vec![0.0f32; params_len];
    let mut momentum = vec![0.0f32; shard]; // optimizer state for my shard only
    let (lr, beta) = (0.02f32, 0.9f32);

    for step in 0..200 {
        let grad: Vec<f32> = (0..params_len)
            .map(|i| 2.0 * (1 + (i + rank) % 3) as f32 * (params[i] - target[i]))
            .collect();
        let mut my_grad = vec![0.0f32; shard];
        comm.reduce_scatter(&grad, &mut my_grad, ReduceOp::Sum)?;
        let mine = &mut params[rank * shard..(rank + 1) * shard];
        for ((p, m), g) in mine.iter_mut().zip(&mut momentum).zip(&my_grad) {
            *m = beta * *m + g / n as f32;
            *p -= lr * *m;
        }
        // Everyone's updated shard, in place: my block already holds mine.
        comm.all_gather_in_place(&mut params)?;
        if rank == 0 && step % 50 == 0 {
            let err = params
                .iter()
                .zip(&target)
                .map(|(p, t)| (p - t).abs())
                .fold(0.0, f32::max);
            println!("step {step}: max |p - t| {err:.4}");
        }
    }
    let err = params
        .iter()
        .zip(&target)
        .map(|(p, t)| (p - t).abs())
        .fold(0.0, f32::max);
    assert!(err < 1e-3, "did not converge: {err}");
    let mut sum = [params.iter().map(|&p| p as f64).sum::<f64>()];
    let mut lo = sum;
    comm.all_reduce_in_place(&mut lo, ReduceOp::Min)?;
    comm.all_reduce_in_place(&mut sum, ReduceOp::Max)?;
    assert_eq!(lo, sum, "ranks disagree on the parameters");
    println!(
        "rank {rank}/{n}: converged, max |p - t| {err:.2e}, state {shard} of {params_len} per rank"
    );
    Ok(())
}
