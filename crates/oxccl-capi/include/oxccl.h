/* oxccl.h: the C ABI of oxccl (crate oxccl-capi), modelled on NCCL's nccl.h: the same
 * calls, enums and numbering with an "oxccl" prefix, for CPU buffers.
 *
 * Return codes: every function but oxcclGetLastError, oxcclGetErrorString and oxcclGetApi
 * returns an oxcclResult_t. On failure oxcclGetLastError() gives the text, which names the
 * rank, the peer, the call and its sequence number where they apply. No call blocks beyond
 * the communicator's timeout (OXCCL_TIMEOUT, see oxcclCommTimeout), except where a timeout
 * is passed explicitly. No C++ exception or Rust panic crosses the ABI: a bug inside the
 * library is oxcclInternalError.
 *
 * Thread-safety: every function may be called from any thread. A communicator may be used
 * from several threads at once; its calls are then serialized in the order they arrive.
 * As in NCCL, every rank must make the same collective calls in the same order, so calls
 * from several threads of one rank need an order of the program's own. Groups
 * (oxcclGroupStart/End) and the last-error text are per thread. A handle must not be
 * destroyed or freed while another thread still uses it.
 *
 * Typical use (one process per rank):
 *
 *   oxcclUniqueId id;
 *   if (rank == 0) oxcclGetUniqueId(&id);
 *   ... send id (its bytes) from rank 0 to every other rank, e.g. with MPI_Bcast ...
 *   oxcclComm_t comm;
 *   if (oxcclCommInitRank(&comm, nranks, &id, rank) != oxcclSuccess)
 *     fprintf(stderr, "%s\n", oxcclGetLastError());
 *   oxcclAllReduce(sendbuf, recvbuf, count, oxcclFloat32, oxcclSum, comm);
 *   oxcclCommDestroy(comm);
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

/* The result of every call. */
typedef enum {
  oxcclSuccess = 0,          /* the call succeeded */
  oxcclInvalidArgument = 1,  /* a bad argument (NULL pointer, unknown enum value, wrong
                                length, rank out of range, bad environment), reported
                                before any data moves */
  oxcclTimeout = 2,          /* the call (or a wait) did not finish within its timeout */
  oxcclPeerLost = 3,         /* a peer died, closed its connections or could not be reached;
                                the communicator cannot be used any more */
  oxcclMismatch = 4,         /* ranks made different calls, or the same call with different
                                arguments (count, type, op, root) */
  oxcclAborted = 5,          /* the communicator was aborted, or failed earlier */
  oxcclRemoteError = 6,      /* another rank failed and said so */
  oxcclSystemError = 7,      /* the system failed: sockets, shared memory, the rendezvous */
  oxcclInternalError = 8,    /* a bug in oxccl */
  oxcclInProgress = 9        /* queued work is still running (oxcclWorkTest reports this
                                through its done flag, not as a return value) */
} oxcclResult_t;

/* The element type of a buffer: NCCL's numbering (ncclDataType_t), then bool (one byte,
 * 0 or 1) and uint16. */
typedef enum {
  oxcclInt8 = 0, oxcclUint8 = 1, oxcclInt32 = 2, oxcclUint32 = 3, oxcclInt64 = 4,
  oxcclUint64 = 5, oxcclFloat16 = 6, oxcclFloat32 = 7, oxcclFloat64 = 8, oxcclBfloat16 = 9,
  oxcclBool = 10, oxcclUint16 = 11
} oxcclDataType_t;

/* The reduction of a reducing collective: NCCL's numbering (ncclRedOp_t; oxcclAvg divides
 * the sum by the number of ranks), then the bitwise ops, for integer and bool types only. */
typedef enum {
  oxcclSum = 0, oxcclProd = 1, oxcclMax = 2, oxcclMin = 3, oxcclAvg = 4,
  oxcclBand = 5, oxcclBor = 6, oxcclBxor = 7
} oxcclRedOp_t;

/* A communicator handle: one rank's membership of a group, from oxcclCommInitRank or
 * oxcclCommInitFromEnv, freed with oxcclCommDestroy. Several handles may share one
 * communicator (the Python module hands out handles to its own); the communicator goes away
 * with its last handle. */
typedef struct oxcclComm* oxcclComm_t;
/* A queued job's handle, from oxcclGroupEnd: wait on it, test it, attach a callback, and
 * free it with oxcclWorkFree. */
typedef struct oxcclWork* oxcclWork_t;

/* The rendezvous id: where rank 0 listens and the group's secret, as a NUL-terminated string
 * ("oxccl1:<ip:port>:<32 hex digits>"). Made by rank 0 with oxcclGetUniqueId and copied to
 * every other rank out of band; it contains the secret, so hand it only to the group's
 * ranks. */
#define OXCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[OXCCL_UNIQUE_ID_BYTES]; } oxcclUniqueId;

/* A completion callback (oxcclWorkOnComplete): arg as registered, and the work's result
 * (oxcclGetLastError on that thread gives a failure's text). Called once a work has
 * finished, on the thread that ran it: the library's stream thread, or
 * a thread in oxcclWorkWait that ran it itself (see there); at once on the registering thread
 * if it had already finished. Must return promptly, must not throw, and must not wait on work
 * of the same communicator. */
typedef void (*oxcclWorkCallback)(void* arg, oxcclResult_t result);

/* The text of the last failure on the calling thread ("" if none): what failed, naming rank,
 * peer, call and sequence number where they apply. Valid until the next oxccl call on this
 * thread. Never fails. */
const char* oxcclGetLastError(void);
/* A static name for a result code ("unknown result code" for a value not in
 * oxcclResult_t), as ncclGetErrorString. Never fails. */
const char* oxcclGetErrorString(oxcclResult_t result);

/* Makes a fresh id in *id, as ncclGetUniqueId: binds a listener on this host's outward
 * interface (port 0) and draws a random secret. The calling process must then be rank 0 of
 * the communicator (it holds the listener). Returns oxcclInvalidArgument for a NULL id,
 * oxcclSystemError when no listener can be bound. */
oxcclResult_t oxcclGetUniqueId(oxcclUniqueId* id);
/* Joins the communicator of *id as rank `rank` (0 <= rank < nranks) of nranks, as
 * ncclCommInitRank; settings come from OXCCL_* environment variables. Every rank calls it
 * with the same id and nranks; it returns once all have joined and the links are up, and
 * *comm is the new handle. Returns oxcclInvalidArgument (NULL pointer, malformed id, rank
 * out of range, bad setting), oxcclTimeout (some rank did not join within OXCCL_TIMEOUT; the
 * text names which), oxcclPeerLost (a rank died during start-up) or oxcclSystemError.
 * *comm is written on success only. */
oxcclResult_t oxcclCommInitRank(oxcclComm_t* comm, int nranks, const oxcclUniqueId* id, int rank);
/* As oxcclCommInitRank, with rank, size, rendezvous address and secret read from the
 * variables of the launcher that started the process: torchrun or `oxccl run` (RANK,
 * WORLD_SIZE, MASTER_ADDR/MASTER_PORT or OXCCL_ROOT, OXCCL_SECRET), Slurm, Open MPI or PMI.
 * Returns oxcclInvalidArgument when the variables are missing or malformed, otherwise as
 * oxcclCommInitRank. */
oxcclResult_t oxcclCommInitFromEnv(oxcclComm_t* comm);
/* Frees the handle; the communicator goes away with its last handle, after its queued calls
 * have finished. NULL does nothing. Returns oxcclSuccess. The handle must not be used
 * afterwards, nor by another thread meanwhile. */
oxcclResult_t oxcclCommDestroy(oxcclComm_t comm);
/* *count = the number of ranks. oxcclInvalidArgument for a NULL argument. */
oxcclResult_t oxcclCommCount(const oxcclComm_t comm, int* count);
/* *rank = this process's rank in the communicator. oxcclInvalidArgument for a NULL argument. */
oxcclResult_t oxcclCommUserRank(const oxcclComm_t comm, int* rank);
/* *seconds = the communicator's timeout: the bound on each call (OXCCL_TIMEOUT).
 * oxcclInvalidArgument for a NULL argument. */
oxcclResult_t oxcclCommTimeout(const oxcclComm_t comm, double* seconds);
/* Sets the communicator's timeout, the bound on each later call, instead of OXCCL_TIMEOUT;
 * it holds for every handle of the communicator. oxcclInvalidArgument for a NULL comm or a
 * timeout that is not a number of seconds from 0.001 to 1e7 (OXCCL_TIMEOUT's bounds). */
oxcclResult_t oxcclCommSetTimeout(const oxcclComm_t comm, double seconds);

/* Collectives, as NCCL's. Counts are in elements of `datatype`. In place as NCCL:
 * sendbuff == recvbuff; for all-gather sendbuff == recvbuff + rank*sendcount; for
 * reduce-scatter recvbuff == sendbuff + rank*recvcount. Every rank of the communicator must
 * make the same call with the same count, type, op and root.
 *
 * Outside a group a call blocks until this rank's part is done (its buffers may then be
 * reused); inside a group (oxcclGroupStart) it is only queued, and its buffers must stay
 * valid until the group's work completes.
 *
 * Return codes: oxcclSuccess; oxcclInvalidArgument before any data moves (NULL comm, unknown
 * type or op, a root out of range, a bitwise op on a float type, a NULL buffer with a
 * nonzero count; a broadcast's sendbuff and a reduce's recvbuff may be NULL on ranks other
 * than the root, where they are not used); and, from the call itself, oxcclTimeout,
 * oxcclPeerLost, oxcclMismatch, oxcclAborted, oxcclRemoteError or oxcclSystemError. After
 * any of these but oxcclInvalidArgument the communicator is failed: destroy it (or make a
 * new one). */

/* Every rank gets in recvbuff the element-wise reduction by op of every rank's sendbuff
 * (count elements each). */
oxcclResult_t oxcclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                             oxcclDataType_t datatype, oxcclRedOp_t op, const oxcclComm_t comm);
/* Every rank gets in recvbuff the root's sendbuff (count elements). */
oxcclResult_t oxcclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                             oxcclDataType_t datatype, int root, const oxcclComm_t comm);
/* The root gets in recvbuff the element-wise reduction by op of every rank's sendbuff (count
 * elements each). */
oxcclResult_t oxcclReduce(const void* sendbuff, void* recvbuff, size_t count,
                          oxcclDataType_t datatype, oxcclRedOp_t op, int root,
                          const oxcclComm_t comm);
/* Every rank gets in recvbuff (nranks*sendcount elements) every rank's sendbuff (sendcount
 * elements), in rank order. */
oxcclResult_t oxcclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                             oxcclDataType_t datatype, const oxcclComm_t comm);
/* Rank r gets in recvbuff (recvcount elements) block r of the element-wise reduction by op
 * of every rank's sendbuff (nranks*recvcount elements). */
oxcclResult_t oxcclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                 oxcclDataType_t datatype, oxcclRedOp_t op,
                                 const oxcclComm_t comm);
/* Block p of this rank's sendbuff goes to rank p, which stores it as block r (this rank) of
 * its recvbuff; count is the elements per block (each buffer has nranks*count). */
oxcclResult_t oxcclAllToAll(const void* sendbuff, void* recvbuff, size_t count,
                            oxcclDataType_t datatype, const oxcclComm_t comm);
/* Returns once every rank has called it. */
oxcclResult_t oxcclBarrier(const oxcclComm_t comm);

/* Groups, as ncclGroupStart/ncclGroupEnd: the collective calls this thread makes between
 * start and end are queued and run in order as one job on the communicator's stream
 * thread. They must all be on one communicator: a call on another one is
 * oxcclInvalidArgument and is not queued. Groups nest; the outermost end submits. Per
 * thread: another thread's calls are not part of this thread's group. */

/* Opens a group (or a nested one). Returns oxcclSuccess. */
oxcclResult_t oxcclGroupStart(void);
/* Closes a group. With work != NULL it returns at once and *work is the job's handle (NULL
 * if the group was empty), to wait on, test and free; the buffers must stay valid until it
 * completes. With work == NULL it waits for the job and returns its result. Returns
 * oxcclInvalidArgument without an open group; otherwise as the collectives. */
oxcclResult_t oxcclGroupEnd(oxcclWork_t* work);

/* Waits at most timeout_s seconds (negative: the communicator's timeout): the work's result,
 * or oxcclTimeout if still running (the work stays valid: wait again, or free it). Several
 * threads may wait on one work. A wait at least as long as the
 * work's own bound (the communicator's timeout for each call in it) runs a work that has not
 * started, when nothing queued before it is still to run, on the calling thread. */
oxcclResult_t oxcclWorkWait(const oxcclWork_t work, double timeout_s);
/* *done = 1 and the work's result once finished; *done = 0 and oxcclSuccess before. Never
 * blocks. oxcclInvalidArgument for a NULL argument. */
oxcclResult_t oxcclWorkTest(const oxcclWork_t work, int* done);
/* Registers cb(arg, result) to run once the work has finished (see oxcclWorkCallback): at
 * once, on this thread, if it already has. One callback per work: a second one, or a NULL
 * cb, is oxcclInvalidArgument. */
oxcclResult_t oxcclWorkOnComplete(const oxcclWork_t work, oxcclWorkCallback cb, void* arg);
/* Frees the handle; the work itself still runs to its end (keep its buffers valid until
 * then). NULL does nothing. Returns oxcclSuccess. */
oxcclResult_t oxcclWorkFree(oxcclWork_t work);

/* Point-to-point: sends and receives that progress together, as NCCL's ncclSend/ncclRecv
 * inside ncclGroupStart/ncclGroupEnd, with tags and receives from any rank; or a collective
 * made of them (a gather, a scatter, an all-to-all whose blocks differ in size). */

/* What a point-to-point group is. oxcclP2pUser: the program's own messages, matched by
 * source and tag, in send order per source and tag (a message that no pending receive takes
 * waits in the receiver's stash, bounded by OXCCL_P2P_STASH). The others: a collective of
 * that name, called by every rank of the communicator in the same order as its other
 * collectives, whose messages (tag 0, named peers only) carry its number: no other call's
 * receive takes them, its errors name it, and no rank runs ahead of a peer that has not
 * begun it. */
typedef enum {
  oxcclP2pUser = 0, oxcclP2pGather = 1, oxcclP2pScatter = 2, oxcclP2pAllToAllv = 3
} oxcclP2pCall_t;

/* One operation of a point-to-point group. */
typedef struct {
  int send;                 /* 1: send count elements of buff to peer; 0: receive them */
  int peer;                 /* the other rank; -1 on a receive of oxcclP2pUser: any rank */
  uint32_t tag;             /* the receive must name the sender's tag (0 in collectives) */
  oxcclDataType_t datatype; /* a receive takes only a message of its type and count */
  void* buff;               /* may be NULL when count is 0 */
  size_t count;             /* elements */
  int source;               /* out: set once the group has completed, on a receive the rank
                               the message came from; -1 on sends (and before) */
} oxcclP2pOp_t;

/* Runs the nops operations of ops as one group: they progress together, so any mix
 * completes at any size (two ranks that both send first included). Sends to this rank itself
 * are matched with its receives from itself. Outside a group it returns once every send has
 * been taken and every receive filled; inside one (oxcclGroupStart) it is queued in order with
 * the group's other calls, and ops and the buffers must stay valid until the work completes
 * (the sources are written then). Every operation is checked before any data moves:
 * oxcclInvalidArgument for a NULL comm, NULL ops with nops > 0, an unknown call or type, a
 * send that is not 0 or 1, a peer outside the communicator (-1 only on a user receive), a
 * nonzero tag in a collective, a NULL buffer with a nonzero count. Otherwise as the
 * collectives; a message of the wrong type or count is oxcclMismatch. */
oxcclResult_t oxcclP2p(oxcclP2pOp_t* ops, size_t nops, oxcclP2pCall_t call, const oxcclComm_t comm);

/* Memory in shared memory, as ncclMemAlloc/ncclMemFree: collectives on it (from any
 * communicator) reach it on every rank of the host with loads and stores instead of
 * cross-memory copies. Page-aligned, contents undefined; freed blocks are cached (at most
 * OXCCL_SHM_POOL_CACHE bytes) and handed out again. oxcclMemFree(NULL) does nothing; any
 * pointer not from oxcclMemAlloc, or freed already, is oxcclInvalidArgument. After fork() a
 * block is shared between parent and child (MAP_SHARED). */
/* *ptr = a block of at least size bytes. oxcclInvalidArgument for a NULL ptr,
 * oxcclSystemError when the shared memory cannot be had. */
oxcclResult_t oxcclMemAlloc(void** ptr, size_t size);
/* Returns a block of oxcclMemAlloc to the cache. */
oxcclResult_t oxcclMemFree(void* ptr);

/* The function table (the capsule's contents): every function above but oxcclGetUniqueId,
 * oxcclCommInitRank and oxcclCommInitFromEnv (communicators come from Python there), in this
 * order. Check version (at least the one you need) and size before use: entries are only
 * added at the end, raising the version, so a caller built for an older version reads the
 * entries it knows where they always were; a caller built for this one must check that size
 * covers the entries it uses. */
#define OXCCL_API_VERSION 4
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
  oxcclResult_t (*comm_set_timeout)(const oxcclComm_t, double); /* since version 3 */
  oxcclResult_t (*p2p)(oxcclP2pOp_t*, size_t, oxcclP2pCall_t, const oxcclComm_t); /* since version 4 */
} oxcclApi_t;

/* This library's function table; static, never NULL, never fails. */
const oxcclApi_t* oxcclGetApi(void);

#ifdef __cplusplus
}
#endif
#endif /* OXCCL_H */
