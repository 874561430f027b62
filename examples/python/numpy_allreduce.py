"""oxccl on numpy arrays: average gradients, gather shards, overlap a queued all_reduce.

    oxccl run -n 4 -- python examples/python/numpy_allreduce.py     # or torchrun, srun, mpirun
"""

import numpy as np

import oxccl

comm = oxccl.init()  # rank, world size and rendezvous from the launcher's environment
rank, n = comm.rank, comm.world_size

# Every rank starts from rank 0's weights.
weights = np.random.default_rng(rank).standard_normal(1_000_000).astype(np.float32)
comm.broadcast(weights, root=0)

# Average "gradients" in place; queue another reduction and keep computing meanwhile.
grads = np.full_like(weights, rank)
handle = comm.all_reduce(grads, op="avg", async_op=True)
norm = float(np.linalg.norm(weights))  # runs while the all_reduce does
handle.wait()
assert np.allclose(grads, (n - 1) / 2)

# Each rank owns a shard; everyone gets all of them.
shard = np.arange(4, dtype=np.int64) + 4 * rank
everything = comm.all_gather(shard)
assert np.array_equal(everything, np.arange(4 * n))
print(f"rank {rank}/{n}: |w| = {norm:.1f}, gathered {everything.size} values; done")
