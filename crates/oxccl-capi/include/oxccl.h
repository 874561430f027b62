/* oxccl.h: the C ABI of oxccl (crate oxccl-capi), NCCL-like.
 *
 * Every function returns an oxcclResult_t; on failure oxcclGetLastError() gives the text
 * (per thread, valid until the next oxccl call on that thread). No call blocks beyond the
 * communicator's timeout (OXCCL_TIMEOUT), except where a timeout is passed explicitly.
 *
 * Link with -loxccl_capi (liboxccl_capi.so), or, inside a Python process that imported
 * oxccl, take the function table from the capsule oxccl._oxccl._C_API ("oxccl._C_API"):
 * it is the same library instance Python uses, and oxccl.Comm.c_comm() gives a handle of a
 * Python communicator. */
#ifndef OXCCL_H
#define OXCCL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  oxcclSuccess = 0,
  oxcclInvalidArgument = 1,
  oxcclTimeout = 2,
  oxcclPeerLost = 3,
  oxcclMismatch = 4,
  oxcclAborted = 5,
  oxcclRemoteError = 6,
  oxcclSystemError = 7,
  oxcclInternalError = 8,
  oxcclInProgress = 9
} oxcclResult_t;

/* NCCL's numbering, then bool and uint16. */
typedef enum {
  oxcclInt8 = 0, oxcclUint8 = 1, oxcclInt32 = 2, oxcclUint32 = 3, oxcclInt64 = 4,
  oxcclUint64 = 5, oxcclFloat16 = 6, oxcclFloat32 = 7, oxcclFloat64 = 8, oxcclBfloat16 = 9,
  oxcclBool = 10, oxcclUint16 = 11
} oxcclDataType_t;

/* NCCL's numbering, then the bitwise ops (integers and bool). */
typedef enum {
  oxcclSum = 0, oxcclProd = 1, oxcclMax = 2, oxcclMin = 3, oxcclAvg = 4,
  oxcclBand = 5, oxcclBor = 6, oxcclBxor = 7
} oxcclRedOp_t;

typedef struct oxcclComm* oxcclComm_t;
typedef struct oxcclWork* oxcclWork_t;

#define OXCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[OXCCL_UNIQUE_ID_BYTES]; } oxcclUniqueId;

/* Called once a work has finished, on the thread that ran it: the library's stream thread, or
 * a thread in oxcclWorkWait that ran it itself (see there); at once on the registering thread
 * if it had already finished. Must return promptly, must not throw, and must not wait on work
 * of the same communicator. */
typedef void (*oxcclWorkCallback)(void* arg, oxcclResult_t result);

const char* oxcclGetLastError(void);
const char* oxcclGetErrorString(oxcclResult_t result);

/* A fresh id: the calling process must be rank 0. */
oxcclResult_t oxcclGetUniqueId(oxcclUniqueId* id);
oxcclResult_t oxcclCommInitRank(oxcclComm_t* comm, int nranks, const oxcclUniqueId* id, int rank);
/* torchrun, `oxccl run`, Slurm, Open MPI or PMI environment. */
oxcclResult_t oxcclCommInitFromEnv(oxcclComm_t* comm);
/* Frees the handle; the communicator goes with its last handle. */
oxcclResult_t oxcclCommDestroy(oxcclComm_t comm);
oxcclResult_t oxcclCommCount(const oxcclComm_t comm, int* count);
oxcclResult_t oxcclCommUserRank(const oxcclComm_t comm, int* rank);
oxcclResult_t oxcclCommTimeout(const oxcclComm_t comm, double* seconds);

/* Collectives: counts in elements; in place as NCCL (sendbuff == recvbuff; for all-gather
 * sendbuff == recvbuff + rank*sendcount; for reduce-scatter recvbuff == sendbuff +
 * rank*recvcount). Blocking, or queued inside a group. A NULL buffer with a nonzero count
 * is oxcclInvalidArgument, except a broadcast's sendbuff and a reduce's recvbuff on ranks
 * other than the root (not read there). */
oxcclResult_t oxcclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                             oxcclDataType_t datatype, oxcclRedOp_t op, const oxcclComm_t comm);
oxcclResult_t oxcclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                             oxcclDataType_t datatype, int root, const oxcclComm_t comm);
oxcclResult_t oxcclReduce(const void* sendbuff, void* recvbuff, size_t count,
                          oxcclDataType_t datatype, oxcclRedOp_t op, int root,
                          const oxcclComm_t comm);
oxcclResult_t oxcclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             oxcclDataType_t datatype, const oxcclComm_t comm);
oxcclResult_t oxcclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 oxcclDataType_t datatype, oxcclRedOp_t op,
                                 const oxcclComm_t comm);
/* count: elements per peer. */
oxcclResult_t oxcclAllToAll(const void* sendbuff, void* recvbuff, size_t count,
                            oxcclDataType_t datatype, const oxcclComm_t comm);
oxcclResult_t oxcclBarrier(const oxcclComm_t comm);

/* Groups: calls between start and end (this thread, one communicator) are queued as one
 * job. End with work != NULL returns at once with its handle (NULL if the group was empty);
 * the buffers must stay valid until it completes. End with work == NULL waits for it. */
oxcclResult_t oxcclGroupStart(void);
oxcclResult_t oxcclGroupEnd(oxcclWork_t* work);

/* Waits at most timeout_s seconds (negative: the communicator's timeout): the work's result,
 * or oxcclTimeout if still running (the work stays valid). A wait at least as long as the
 * work's own bound (the communicator's timeout for each call in it) runs a work that has not
 * started, when nothing queued before it is still to run, on the calling thread. */
oxcclResult_t oxcclWorkWait(const oxcclWork_t work, double timeout_s);
/* *done = 1 and the work's result once finished; *done = 0 and oxcclSuccess before. */
oxcclResult_t oxcclWorkTest(const oxcclWork_t work, int* done);
oxcclResult_t oxcclWorkOnComplete(const oxcclWork_t work, oxcclWorkCallback cb, void* arg);
/* Frees the handle; the work still runs to its end. */
oxcclResult_t oxcclWorkFree(oxcclWork_t work);

/* Memory in shared memory, as ncclMemAlloc/ncclMemFree: collectives on it (from any
 * communicator) reach it on every rank of the host with loads and stores instead of
 * cross-memory copies. Page-aligned, contents undefined; freed blocks are cached (at most
 * OXCCL_SHM_POOL_CACHE bytes) and handed out again. oxcclMemFree(NULL) does nothing; any
 * pointer not from oxcclMemAlloc, or freed already, is oxcclInvalidArgument. After fork() a
 * block is shared between parent and child (MAP_SHARED). */
oxcclResult_t oxcclMemAlloc(void** ptr, size_t size);
oxcclResult_t oxcclMemFree(void* ptr);

/* The function table (the capsule's contents). */
#define OXCCL_API_VERSION 2
typedef struct {
  uint32_t version; /* OXCCL_API_VERSION */
  uint32_t size;    /* sizeof(oxcclApi_t) */
  const char* (*get_last_error)(void);
  const char* (*get_error_string)(oxcclResult_t);
  oxcclResult_t (*comm_destroy)(oxcclComm_t);
  oxcclResult_t (*comm_count)(const oxcclComm_t, int*);
  oxcclResult_t (*comm_user_rank)(const oxcclComm_t, int*);
  oxcclResult_t (*comm_timeout)(const oxcclComm_t, double*);
  oxcclResult_t (*all_reduce)(const void*, void*, size_t, oxcclDataType_t, oxcclRedOp_t, const oxcclComm_t);
  oxcclResult_t (*broadcast)(const void*, void*, size_t, oxcclDataType_t, int, const oxcclComm_t);
  oxcclResult_t (*reduce)(const void*, void*, size_t, oxcclDataType_t, oxcclRedOp_t, int, const oxcclComm_t);
  oxcclResult_t (*all_gather)(const void*, void*, size_t, oxcclDataType_t, const oxcclComm_t);
  oxcclResult_t (*reduce_scatter)(const void*, void*, size_t, oxcclDataType_t, oxcclRedOp_t, const oxcclComm_t);
  oxcclResult_t (*all_to_all)(const void*, void*, size_t, oxcclDataType_t, const oxcclComm_t);
  oxcclResult_t (*barrier)(const oxcclComm_t);
  oxcclResult_t (*group_start)(void);
  oxcclResult_t (*group_end)(oxcclWork_t*);
  oxcclResult_t (*work_wait)(const oxcclWork_t, double);
  oxcclResult_t (*work_test)(const oxcclWork_t, int*);
  oxcclResult_t (*work_on_complete)(const oxcclWork_t, oxcclWorkCallback, void*);
  oxcclResult_t (*work_free)(oxcclWork_t);
  oxcclResult_t (*mem_alloc)(void**, size_t);  /* since version 2 */
  oxcclResult_t (*mem_free)(void*);            /* since version 2 */
} oxcclApi_t;

const oxcclApi_t* oxcclGetApi(void);

#ifdef __cplusplus
}
#endif
#endif /* OXCCL_H */
