//! Data-parallel SGD: every rank holds the whole model (here a linear regression) and a shard
//! of the data; each step averages the gradients with `all_reduce(Avg)`, so every rank takes
//! the same step and the models stay identical. The gradient all-reduce of step t+1 is
//! queued (`all_reduce_async`) while the loss of step t is computed.
//!
//! ```sh
//! cargo build --release -p oxccl-examples -p oxccl-cli
//! target/release/oxccl run -n 4 -- target/release/dp_sgd
//! ```

use std::sync::Arc;

use oxccl::{Communicator, ReduceOp};

const DIM: usize = 64;
const SAMPLES_PER_RANK: usize = 512;

/// Deterministic pseudo-random numbers in [-1, 1).
fn rand(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    (*seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

fn main() -> oxccl::Result<()> {
    let comm = Arc::new(Communicator::from_env()?);
    let (rank, n) = (comm.rank(), comm.world_size());

    // The true weights are known to every rank only to generate data; the model learns them.
    let mut seed = 42u64;
    let truth: Vec<f32> = (0..DIM).map(|_| rand(&mut seed)).collect();
    let mut seed = 1000 + rank as u64;
    let xs: Vec<Vec<f32>> = (0..SAMPLES_PER_RANK)
        .map(|_| (0..DIM).map(|_| rand(&mut seed)).collect())
        .collect();
    let ys: Vec<f32> = xs
        .iter()
        .map(|x| x.iter().zip(&truth).map(|(a, b)| a * b).sum())
        .collect();

    // Same start everywhere: rank 0's initialization.
    let mut w: Vec<f32> = (0..DIM).map(|i| (i * (rank + 1)) as f32 * 0.01).collect();
    comm.broadcast_in_place(&mut w, 0)?;

    let lr = 0.1f32;
    let mut loss = [0.0f64];
    for step in 0..200 {
        let mut grad = vec![0.0f32; DIM];
        let mut local_loss = 0.0f64;
        for (x, y) in xs.iter().zip(&ys) {
            let err: f32 = x.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() - y;
            local_loss += (err * err) as f64;
            for (g, xi) in grad.iter_mut().zip(x) {
                *g += 2.0 * err * xi / SAMPLES_PER_RANK as f32;
            }
        }
        // Queue the gradient average; meanwhile average the loss (ordered after it).
        let work = comm.all_reduce_async(grad, ReduceOp::Avg);
        loss[0] = local_loss / SAMPLES_PER_RANK as f64;
        comm.all_reduce_in_place(&mut loss, ReduceOp::Avg)?;
        let grad = work.wait()?;
        for (wi, g) in w.iter_mut().zip(&grad) {
            *wi -= lr * g;
        }
        if rank == 0 && step % 50 == 0 {
            println!("step {step}: loss {:.6}", loss[0]);
        }
    }

    // Every rank holds the same model, and it has learned the truth.
    let mut lo = w.clone();
    let mut hi = w.clone();
    comm.all_reduce_in_place(&mut lo, ReduceOp::Min)?;
    comm.all_reduce_in_place(&mut hi, ReduceOp::Max)?;
    assert_eq!(lo, hi, "models diverged");
    let dist: f32 = w
        .iter()
        .zip(&truth)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        loss[0] < 1e-4 && dist < 1e-2,
        "did not converge: loss {} dist {dist}",
        loss[0]
    );
    println!(
        "rank {rank}/{n}: converged, final loss {:.2e}, max |w - truth| {dist:.2e}",
        loss[0]
    );
    Ok(())
}
