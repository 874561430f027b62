/* Open MPI's MPI_Reduce (float32, sum, root 0) in the columns of ../shared/anchors'
 * mpi_coll_bench.c, which has no reduce row: the same timing loop (warm-up call, barrier,
 * 100 iterations up to 4 MB and 10 above, slowest rank's average). busbw factor 1 (nccl-tests).
 * Build: mpicc -O3 -o mpi_reduce_bench mpi_reduce_bench.c
 * Run:   mpirun -n 2 ./mpi_reduce_bench [min_bytes] [max_bytes]   (sizes: powers of 4) */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int r, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t lo = argc > 1 ? strtoull(argv[1], 0, 10) : 8, hi = argc > 2 ? strtoull(argv[2], 0, 10) : 64UL << 20;
  float *s = malloc(hi + 64), *d = malloc(hi + 64);
  if (!r) printf("# mpi reduce ranks=%d\n#%12s %10s %10s %10s %6s\n", n, "bytes", "time(us)", "algbw", "busbw", "check");
  for (size_t b = lo; b <= hi; b *= 4) {
    size_t cnt = b / 4;
    for (size_t i = 0; i < cnt; i++) s[i] = (float)(r + 1);
    int iters = b > (4UL << 20) ? 10 : 100, bad = 0;
    MPI_Reduce(s, d, cnt, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD); /* warm-up */
    MPI_Barrier(MPI_COMM_WORLD);
    double t = MPI_Wtime();
    for (int it = 0; it < iters; it++) MPI_Reduce(s, d, cnt, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
    t = (MPI_Wtime() - t) / iters;
    double mx;
    MPI_Allreduce(&t, &mx, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (!r && cnt) bad = d[cnt - 1] != n * (n + 1) / 2.0f;
    int anybad;
    MPI_Allreduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!r) printf(" %12zu %10.2f %10.3f %10.3f %6s\n", b, mx * 1e6, b / mx / 1e9, b / mx / 1e9, anybad ? "BAD" : "ok");
  }
  free(s); free(d);
  MPI_Finalize();
  return 0;
}
