/* Two ranks in two processes (fork): all-reduce, then all-gather queued in a group with a
 * completion callback, then all-reduce on oxcclMemAlloc'd shared memory. Prints "oxccl C example ok" from each rank, or the error. Built and
 * run by tests/c_example.rs:  cc allreduce.c -I../include -L<dir> -loxccl_capi */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "oxccl.h"

#define CHECK(call)                                                                  \
  do {                                                                               \
    oxcclResult_t r_ = (call);                                                       \
    if (r_ != oxcclSuccess) {                                                        \
      fprintf(stderr, "%s failed: %s: %s\n", #call, oxcclGetErrorString(r_), oxcclGetLastError()); \
      return 1;                                                                      \
    }                                                                                \
  } while (0)

static volatile int called = -1;

static void on_done(void* arg, oxcclResult_t r) { *(volatile int*)arg = (int)r; }

static int run(const oxcclUniqueId* id, int rank) {
  oxcclComm_t comm;
  CHECK(oxcclCommInitRank(&comm, 2, id, rank));
  int n = 0, me = -1;
  CHECK(oxcclCommCount(comm, &n));
  CHECK(oxcclCommUserRank(comm, &me));
  if (n != 2 || me != rank) { fprintf(stderr, "count %d rank %d\n", n, me); return 1; }

  float x[1000];
  for (int i = 0; i < 1000; i++) x[i] = (float)(i * (rank + 1));
  CHECK(oxcclAllReduce(x, x, 1000, oxcclFloat32, oxcclSum, comm));
  for (int i = 0; i < 1000; i++)
    if (x[i] != (float)(3 * i)) { fprintf(stderr, "x[%d] = %g\n", i, x[i]); return 1; }

  int64_t mine[3] = {rank, rank * 10, rank * 100}, all[6];
  oxcclWork_t work = NULL;
  CHECK(oxcclGroupStart());
  CHECK(oxcclAllGather(mine, all, 3, oxcclInt64, comm));
  CHECK(oxcclGroupEnd(&work));
  CHECK(oxcclWorkOnComplete(work, on_done, (void*)&called));
  CHECK(oxcclWorkWait(work, -1.0));
  int done = 0;
  CHECK(oxcclWorkTest(work, &done));
  CHECK(oxcclWorkFree(work));
  for (int r = 0; r < 2; r++)
    if (all[3 * r] != r || all[3 * r + 1] != 10 * r || all[3 * r + 2] != 100 * r) {
      fprintf(stderr, "all_gather block %d wrong\n", r); return 1;
    }
  while (called < 0) usleep(100); /* the callback runs just after waiters wake */
  if (!done || called != oxcclSuccess) { fprintf(stderr, "done %d callback %d\n", done, called); return 1; }

  /* buffers in shared memory (oxcclMemAlloc): the same sums; a freed block comes back */
  size_t count = 1 << 18;
  float* y = NULL;
  for (int round = 0; round < 2; round++) {
    float* prev = y;
    CHECK(oxcclMemAlloc((void**)&y, count * sizeof(float)));
    if (round == 1 && y != prev) { fprintf(stderr, "a freed block was not reused\n"); return 1; }
    for (size_t i = 0; i < count; i++) y[i] = (float)((i % 1000) * (rank + 1) + round);
    CHECK(oxcclAllReduce(y, y, count, oxcclFloat32, oxcclSum, comm));
    for (size_t i = 0; i < count; i++)
      if (y[i] != (float)(3 * (i % 1000) + 2 * round)) { fprintf(stderr, "y[%zu] = %g\n", i, y[i]); return 1; }
    CHECK(oxcclMemFree(y));
  }
  if (oxcclMemFree(y) != oxcclInvalidArgument) { fprintf(stderr, "a double free was accepted\n"); return 1; }
  CHECK(oxcclMemFree(NULL));

  /* a wrong argument is an error code with a text, not a crash */
  if (oxcclAllReduce(x, x, 10, (oxcclDataType_t)99, oxcclSum, comm) != oxcclInvalidArgument) return 1;
  printf("rank %d: %s\n", rank, oxcclGetLastError());
  CHECK(oxcclCommDestroy(comm));
  printf("rank %d: oxccl C example ok\n", rank);
  return 0;
}

int main(void) {
  oxcclUniqueId id;
  CHECK(oxcclGetUniqueId(&id));
  fflush(stdout);
  pid_t child = fork();
  if (child == 0) return run(&id, 1);
  int rc = run(&id, 0), status = 0;
  waitpid(child, &status, 0);
  return rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
}
