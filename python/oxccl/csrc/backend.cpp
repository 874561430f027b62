// oxccl's torch backend in C++: a c10d::Backend whose hot calls go straight to the Rust
// library through its C ABI (oxccl.h), taken from the capsule oxccl._oxccl._C_API, so it is
// the library instance and the communicator that the Python backend (oxccl/torch.py,
// BackendOxccl) already made. Every other call, and every call these paths do not take
// (PREMUL_SUM, non-contiguous or overlapping tensors, uneven all-to-all, several tensors in
// one allreduce/broadcast, sparse, complex or int16 reductions, empty lists, ...), is
// delegated to that Python backend, which does what gloo does or raises before any data
// moves; with the GIL, in call order: held point-to-point operations are flushed before a
// collective of this file.
//
// Small blocking calls (<= kInlineMaxBytes in all, opts.asyncOp false: async_op=False) run on
// the calling thread and return a completed Work. Larger ones, and asynchronous calls of any
// size (async_op=True, and torch's own callers, whose options default to asyncOp), are queued
// on the communicator's stream (oxcclGroupStart/End), so they return before the peers arrive,
// and return a QueuedWork: is_completed() asks the library, wait() is bounded by the group's
// timeout (or wait(timeout=)), and its future is completed by a completion thread of this
// file, never by the library's stream thread, so a then() callback may itself run
// collectives. A wait() without a shorter timeout runs a queued call that has not started
// yet itself (oxcclWorkWait), and a call without a future lets go of its tensors in its
// QueuedWork: `async_op=True` then `wait()` costs no thread hop in the common case.

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/utils/pybind.h>  // tensor and intrusive_ptr casters (not torch/extension.h: compiles in half the time)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cxxabi.h>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <pthread.h>
#include <unistd.h>
#include <vector>

#include "groups.h"
#include "oxccl.h"

namespace py = pybind11;
using c10d::OpType;
using c10d::Work;

namespace oxccl_torch {

constexpr size_t kInlineMaxBytes = size_t(1) << 20;  // as INLINE_MAX_BYTES in torch.py

const oxcclApi_t* g_api = nullptr;  // the library's table, set by the first backend

void defineInferenceFunctions(py::module_& m);  // inference.cpp

// ------------------------------------------------------------------------------------------
// Errors: the oxccl exception classes (oxccl._errors) on the calling thread, a
// DistBackendError in futures.
// ------------------------------------------------------------------------------------------
const char* errorClass(oxcclResult_t r) {
  switch (r) {
    case oxcclTimeout: return "TimeoutError";
    case oxcclPeerLost: return "PeerLostError";
    case oxcclMismatch: return "MismatchError";
    case oxcclInvalidArgument: return "InvalidArgumentError";
    case oxcclAborted: return "AbortedError";
    default: return "Error";
  }
}

[[noreturn]] void raise(oxcclResult_t r, const std::string& msg) {
  py::gil_scoped_acquire gil;
  py::object cls = py::module_::import("oxccl._errors").attr(errorClass(r));
  PyErr_SetString(cls.ptr(), msg.c_str());
  throw py::error_already_set();
}

// ------------------------------------------------------------------------------------------
// Completion threads: run queued tasks (marking futures) off the library's stream thread. A
// task that blocks (a then() callback running a collective) does not hold up the others: a
// new thread starts whenever none is idle; threads beyond one end after a second idle.
//
// At exit the queued calls still in flight are drained (drain(): from an atexit hook of
// oxccl.torch while the interpreter is alive, and from a static destructor as a safety net),
// so no completion thread is still marking a future, holding a tensor or a callback, while the
// interpreter and the process tear down; a thread the interpreter ends anyway (it exits
// threads that want the GIL after finalization, by a forced unwind) ends cleanly.
// ------------------------------------------------------------------------------------------
class Completers {
 public:
  // A queued call whose completion task is still to come (and run): drain() waits for it.
  void begin() {
    std::lock_guard<std::mutex> lock(m_);
    pending_++;
  }
  void end() {
    std::lock_guard<std::mutex> lock(m_);
    if (--pending_ == 0) drained_.notify_all();
  }

  void push(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(m_);
    q_.push_back(std::move(task));
    if (idle_ == 0) {
      threads_++;
      std::thread([this] { loop(); }).detach();
    } else {
      cv_.notify_one();
    }
  }

  // Waits (at most `seconds`) until every queued call has completed and its task has run;
  // true if so.
  bool drain(double seconds) {
    std::unique_lock<std::mutex> lock(m_);
    return drained_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return pending_ == 0; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    while (true) {
      idle_++;
      bool got = cv_.wait_for(lock, std::chrono::seconds(1), [this] { return !q_.empty(); });
      idle_--;
      if (!got) {
        if (threads_ > 1) {
          threads_--;
          return;
        }
        continue;
      }
      auto task = std::move(q_.front());
      q_.pop_front();
      lock.unlock();
      try {
        task();
      } catch (abi::__forced_unwind&) {  // the thread is being ended (pthread_exit): let it
        lock.lock();
        threads_--;
        throw;
      } catch (...) {  // never let a completion thread die
      }
      lock.lock();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::condition_variable drained_;
  std::deque<std::function<void()>> q_;
  int idle_ = 0;
  int threads_ = 0;
  int pending_ = 0;
};

Completers& completers() {
  static auto* c = new Completers();  // never destroyed: detached threads use it
  return *c;
}

// The safety net: when the process exits without the atexit hook having drained (exit from
// C++, os._exit is not affected), give queued calls a moment to complete first.
struct DrainAtExit {
  ~DrainAtExit() { completers().drain(2.0); }
} g_drain_at_exit;

c10::intrusive_ptr<c10::ivalue::Future> newFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

// ------------------------------------------------------------------------------------------
// Works.
// ------------------------------------------------------------------------------------------
// A call that has finished (it ran inline).
class DoneWork : public Work {
 public:
  DoneWork(std::vector<at::Tensor> result, OpType type) : Work(-1, type), result_(std::move(result)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = newFuture();
    f->markCompleted(c10::IValue(result_));
    return f;
  }

 private:
  std::vector<at::Tensor> result_;
};

// What a queued call and its completion share. Two holders: the QueuedWork (`owned`) and the
// completion (`pending`: the library's callback, then the completion task it may hand over
// to); the last to let go deletes it, under `m`, and never on the library's stream thread (see
// QueuedWork::onComplete).
struct Completion {
  std::mutex m;
  bool done = false;
  oxcclResult_t code = oxcclSuccess;
  std::string msg;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  bool marked = false;  // fut has been completed (by the completion task, wait or getFuture)
  std::vector<at::Tensor> keep;  // the call's tensors, alive until it has finished
  bool owned = true;    // the QueuedWork still exists
  bool pending = true;  // the completion (callback or its task) still holds this
};

void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, oxcclResult_t code,
                    const std::string& msg, const std::vector<at::Tensor>& result) {
  if (code == oxcclSuccess) {
    fut->markCompleted(c10::IValue(result));
  } else {
    fut->setError(std::make_exception_ptr(c10::DistBackendError(msg)));
  }
}

// A call queued on the communicator's stream.
class QueuedWork : public Work {
 public:
  QueuedWork(const oxcclApi_t* api, oxcclWork_t w, std::vector<at::Tensor> result, OpType type,
             double timeout_s, int rank, std::string what)
      : Work(rank, type), api_(api), w_(w), result_(std::move(result)), timeout_s_(timeout_s),
        rank_(rank), what_(std::move(what)), c_(new Completion()) {
    c_->keep = result_;
    completers().begin();
    oxcclResult_t r = api_->work_on_complete(w_, &QueuedWork::onComplete, c_);
    if (r != oxcclSuccess) {  // cannot happen for a fresh work; keep it and its tensors for good
      c_ = new Completion();
      c_->pending = false;
      completers().end();
    }
  }

  ~QueuedWork() override {
    api_->work_free(w_);
    std::vector<at::Tensor> keep;
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    bool last;
    {
      std::lock_guard<std::mutex> lock(c_->m);
      c_->owned = false;
      last = !c_->pending;
      if (last) {  // the call has finished and its completion let go: let go here
        keep.swap(c_->keep);
        fut = std::move(c_->fut);
      }
    }
    if (last) delete c_;  // else the completion task deletes it
  }

  bool isCompleted() override {
    int done = 0;
    api_->work_test(w_, &done);
    return done != 0;
  }

  bool isSuccess() const override {
    int done = 0;
    return api_->work_test(w_, &done) == oxcclSuccess && done;
  }

  std::exception_ptr exception() const override {
    int done = 0;
    oxcclResult_t r = api_->work_test(w_, &done);
    if (!done || r == oxcclSuccess) return nullptr;
    return std::make_exception_ptr(c10::DistBackendError(api_->get_last_error()));
  }

  bool wait(std::chrono::milliseconds timeout) override {
    // A negative timeout expires at once (0 is torch's "none given": the group's timeout;
    // oxccl.torch makes an explicit work.wait(timeout=timedelta(0)) expire at once too).
    if (timeout.count() < 0) return waitNow();
    bool explicit_ = timeout != ::kNoTimeout && timeout.count() > 0;
    double t = explicit_ ? timeout.count() / 1000.0 : timeout_s_;
    // torch calls wait without the GIL. A wait as long as the call's own bound runs a call
    // that has not started on this thread (oxcclWorkWait).
    oxcclResult_t r = api_->work_wait(w_, t);
    if (r == oxcclSuccess) {
      settleIfDone();  // as gloo's: once wait() has returned, the future is done too
      return true;
    }
    int done = 0;
    api_->work_test(w_, &done);
    if (r == oxcclTimeout && !done) {
      raise(oxcclTimeout, "oxccl: rank " + std::to_string(rank_) + ": " + what_ + " did not complete within " +
                              std::to_string(t) + " s" +
                              (explicit_ ? " given to work.wait(timeout=)" : " (the group's timeout)"));
    }
    raise(r, api_->get_last_error());
  }

  // wait() with a timeout that has already expired: its error if the call has finished with
  // one, true if it has finished, else an oxccl TimeoutError.
  bool waitNow() {
    int done = 0;
    oxcclResult_t r = api_->work_test(w_, &done);
    if (!done) {
      raise(oxcclTimeout, "oxccl: rank " + std::to_string(rank_) + ": " + what_ +
                              " did not complete within the non-positive timeout given to "
                              "work.wait(timeout=): Timed out waiting for it");
    }
    if (r != oxcclSuccess) raise(r, api_->get_last_error());
    return true;
  }

  std::vector<at::Tensor> result() override { return result_; }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    bool now = false;
    oxcclResult_t code;
    std::string msg;
    {
      std::lock_guard<std::mutex> lock(c_->m);
      if (!c_->fut) c_->fut = newFuture();
      fut = c_->fut;
      if (c_->done && !c_->marked) {
        c_->marked = true;
        now = true;
        code = c_->code;
        msg = c_->msg;
      }
    }
    if (now) {
      completeFuture(fut, code, msg, result_);
    } else {
      settleIfDone();  // finished, its completion task not yet run: done now all the same
    }
    return fut;
  }

 private:
  // Completes the future now (once) if it exists and the library says the call has finished,
  // without waiting for the completion task: after a wait() that returned, or when a finished
  // call's future is asked for, it is done (as gloo's). The completion task then finds it
  // marked and only lets go of the tensors.
  void settleIfDone() {
    int done = 0;
    oxcclResult_t r = api_->work_test(w_, &done);
    if (!done) return;
    std::string msg = r == oxcclSuccess ? std::string() : std::string(api_->get_last_error());
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> lock(c_->m);
      if (!c_->fut || c_->marked) return;
      c_->marked = true;
      fut = c_->fut;
    }
    completeFuture(fut, r, msg, result_);
  }

  // The library's completion callback: on the thread that ran the call (its stream thread, or
  // a thread in wait() that ran it). When nothing is to be done but letting go of the tensors
  // and the QueuedWork still exists, the QueuedWork does that later, on its own thread: no
  // hand-over. Otherwise (a future to complete, whose then() callbacks may run collectives;
  // or the QueuedWork gone, so this is the last holder of tensors whose release may need the
  // GIL) a completion thread does it: never the stream thread.
  static void onComplete(void* arg, oxcclResult_t code) {
    auto* c = static_cast<Completion*>(arg);
    std::string msg = code == oxcclSuccess ? std::string() : std::string(g_api->get_last_error());
    bool handOver;
    {
      std::lock_guard<std::mutex> lock(c->m);
      c->done = true;
      c->code = code;
      c->msg = msg;
      handOver = !c->owned || (c->fut && !c->marked);
      if (!handOver) c->pending = false;  // the QueuedWork lets go (and deletes c) on its thread
    }
    if (!handOver) {  // c may be gone already: not touched again
      completers().end();
      return;
    }
    completers().push([c, code, msg] {
      struct Ended {  // counted done once the tensors and the future are let go of
        ~Ended() { completers().end(); }
      } ended;
      c10::intrusive_ptr<c10::ivalue::Future> fut;
      std::vector<at::Tensor> keep;
      c10::intrusive_ptr<c10::ivalue::Future> drop;
      bool last;
      {
        std::lock_guard<std::mutex> lock(c->m);
        if (c->fut && !c->marked) {
          c->marked = true;
          fut = c->fut;
        }
        keep.swap(c->keep);
        c->pending = false;
        last = !c->owned;
        if (last) drop = std::move(c->fut);
      }
      if (fut) completeFuture(fut, code, msg, keep);
      if (last) delete c;
    });
  }

  const oxcclApi_t* api_;
  oxcclWork_t w_;
  std::vector<at::Tensor> result_;
  double timeout_s_;
  int rank_;
  std::string what_;
  Completion* c_;
};


// The Work of a delegated call: the Python backend's Work, asked for everything (also
// is_completed and the source rank, which torch's own wrapper does not forward).
class DelegatedWork : public Work {
 public:
  explicit DelegatedWork(py::object w) : Work(-1, OpType::UNKNOWN), w_(std::move(w)) {}
  ~DelegatedWork() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      w_ = py::object();
    } else {
      w_.release();  // the interpreter is gone: leak rather than crash
    }
  }
  bool isCompleted() override { return call("is_completed").cast<bool>(); }
  bool isSuccess() const override { return const_cast<DelegatedWork*>(this)->call("is_success").cast<bool>(); }
  bool wait(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    if (timeout == ::kNoTimeout) return w_.attr("wait")().cast<bool>();
    return w_.attr("wait")(timeout).cast<bool>();
  }
  // wait() with an expired timeout: the Python backend's wait with a negative one.
  bool waitNow() {
    py::gil_scoped_acquire gil;
    return w_.attr("wait")(std::chrono::milliseconds(-1)).cast<bool>();
  }
  int sourceRank() const override { return const_cast<DelegatedWork*>(this)->call("_source_rank").cast<int>(); }
  std::vector<at::Tensor> result() override { return call("result").cast<std::vector<at::Tensor>>(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    return w_.cast<c10::intrusive_ptr<Work>>()->getFuture();
  }

 private:
  py::object call(const char* name) {
    py::gil_scoped_acquire gil;
    return w_.attr(name)();
  }
  py::object w_;
};

// ------------------------------------------------------------------------------------------
// Tensors and options.
// ------------------------------------------------------------------------------------------
// oxccl's data type of a tensor, or -1.
int dtypeOf(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kChar: return oxcclInt8;
    case at::kByte: return oxcclUint8;
    case at::kInt: return oxcclInt32;
    case at::kUInt32: return oxcclUint32;
    case at::kLong: return oxcclInt64;
    case at::kUInt64: return oxcclUint64;
    case at::kHalf: return oxcclFloat16;
    case at::kFloat: return oxcclFloat32;
    case at::kDouble: return oxcclFloat64;
    case at::kBFloat16: return oxcclBfloat16;
    case at::kBool: return oxcclBool;
    case at::kUInt16: return oxcclUint16;
    default: return -1;
  }
}

// oxccl's op, or -1 (PREMUL_SUM and anything else go to the Python backend).
int opOf(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return oxcclSum;
    case c10d::ReduceOp::PRODUCT: return oxcclProd;
    case c10d::ReduceOp::MAX: return oxcclMax;
    case c10d::ReduceOp::MIN: return oxcclMin;
    case c10d::ReduceOp::AVG: return oxcclAvg;
    case c10d::ReduceOp::BAND: return oxcclBand;
    case c10d::ReduceOp::BOR: return oxcclBor;
    case c10d::ReduceOp::BXOR: return oxcclBxor;
    default: return -1;
  }
}

// A dense CPU tensor this file can hand to the library as is.
bool plain(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && !t.is_conj() &&
         !t.is_neg();
}

bool plain(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts)
    if (!plain(t)) return false;
  return true;
}

// One library call.
enum class Kind { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, AllToAll, Barrier };

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;  // all_gather: per rank (sendcount); reduce_scatter: recvcount; all_to_all: per peer
  int dtype;
  int op;
  int root;
};

// ------------------------------------------------------------------------------------------
// The backend.
// ------------------------------------------------------------------------------------------
class BackendOxcclCpp : public c10d::Backend {
 public:
  BackendOxcclCpp(py::object py, uintptr_t comm, const oxcclApi_t* api, double timeout_s, py::object wrap)
      : Backend(py.attr("rank")().cast<int>(), py.attr("size")().cast<int>()), py_(std::move(py)),
        wrap_(std::move(wrap)), api_(api), comm_(reinterpret_cast<oxcclComm_t>(comm)), timeout_s_(timeout_s) {
    // The group owns the communicator's handle; the inference ops reach it by its handle.
    group_ = std::make_shared<Group>(api_, comm_, getRank(), getSize());
    handle_ = registerGroup(group_);
  }

  ~BackendOxcclCpp() override {
    unregisterGroup(handle_);
    group_.reset();  // the communicator's handle goes with the last call holding the group
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      py_ = py::object();
      wrap_ = py::object();
    } else {
      py_.release();
      wrap_.release();
    }
  }

  const std::string getBackendName() const override { return "oxccl"; }
  bool supportsSplitting() const override { return true; }

  // dist.set_timeout (ProcessGroup.set_timeout): the bound on every later call of the group (the
  // communicator's timeout, which the calls handed to the Python backend share), and the
  // group's timeout for the groups made from it.
  void setTimeout(std::chrono::milliseconds timeout) override {
    if (timeout.count() <= 0)
      raise(oxcclInvalidArgument, "oxccl: rank " + std::to_string(getRank()) +
                                      ": set_timeout: the timeout (" + std::to_string(timeout.count()) +
                                      " ms) is not positive");
    check(api_->comm_set_timeout(comm_, timeout.count() / 1000.0));
    timeout_s_ = timeout.count() / 1000.0;
    py::gil_scoped_acquire gil;
    py_.attr("_timeout") = py::module_::import("datetime").attr("timedelta")(py::arg("milliseconds") = timeout.count());
  }
  bool supportsCoalescing() const override { return false; }

  c10::intrusive_ptr<Options> getBackendOptions() override {
    py::gil_scoped_acquire gil;
    return py_.attr("options").cast<c10::intrusive_ptr<Options>>();
  }

  // Sequence numbers, as gloo's: every collective call counts, from 0 on every rank (torch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL compares them across ranks). Point-to-point calls do not.
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  void setSequenceNumberForGroup() override {}  // nothing to agree on: 0 everywhere

  // -- hot calls -------------------------------------------------------------------------
  // One dense tensor of a library dtype and op; every other form (several tensors, gloo's
  // local reduction of them; sparse, non-contiguous, complex, int16; an empty list, an error)
  // is the Python backend's.
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) override {
    seq_++;
    int op = opOf(opts.reduceOp);
    if (tensors.size() != 1 || op < 0 || !plain(tensors[0])) return delegate("allreduce", tensors, opts);
    auto& t = tensors[0];
    int dt = dtypeOf(t);
    if (dt < 0) return delegate("allreduce", tensors, opts);
    std::vector<Call> calls{{Kind::AllReduce, t.data_ptr(), t.data_ptr(), size_t(t.numel()), dt, op, 0}};
    return run("all_reduce", calls, tensors, OpType::ALLREDUCE, opts.asyncOp);
  }

  // Each tensor reduced on its own; tensors sharing memory (reduced as gloo does, once per
  // position) and the rest of the forms above go to the Python backend.
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) override {
    seq_++;
    int op = opOf(opts.reduceOp);
    if (tensors.empty() || op < 0 || !plain(tensors) || anyOverlap(tensors))
      return delegate("allreduce_coalesced", tensors, opts);
    std::vector<Call> calls;
    for (auto& t : tensors) {
      int dt = dtypeOf(t);
      if (dt < 0) return delegate("allreduce_coalesced", tensors, opts);
      calls.push_back({Kind::AllReduce, t.data_ptr(), t.data_ptr(), size_t(t.numel()), dt, op, 0});
    }
    return run("all_reduce", calls, tensors, OpType::ALLREDUCE_COALESCED, opts.asyncOp);
  }

  // One tensor (several: gloo's tensors[rootTensor] into every one, in Python).
  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    seq_++;
    checkRoot("broadcast", opts.rootRank);
    if (tensors.size() != 1 || opts.rootTensor != 0 || !plain(tensors[0])) return delegate("broadcast", tensors, opts);
    auto& t = tensors[0];
    std::vector<Call> calls{{Kind::Broadcast, t.data_ptr(), t.data_ptr(), t.nbytes(), oxcclUint8, oxcclSum,
                             int(opts.rootRank)}};
    return run("broadcast", calls, tensors, OpType::BROADCAST, opts.asyncOp);
  }

  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    seq_++;
    checkRoot("reduce", opts.rootRank);
    int op = opOf(opts.reduceOp);
    if (tensors.size() != 1 || opts.rootTensor != 0 || op < 0 || !plain(tensors[0]))
      return delegate("reduce", tensors, opts);
    auto& t = tensors[0];
    int dt = dtypeOf(t);
    if (dt < 0) return delegate("reduce", tensors, opts);
    std::vector<Call> calls{{Kind::Reduce, t.data_ptr(), t.data_ptr(), size_t(t.numel()), dt, op, int(opts.rootRank)}};
    return run("reduce", calls, tensors, OpType::REDUCE, opts.asyncOp);
  }

  c10::intrusive_ptr<Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                             const c10d::AllgatherOptions& opts) override {
    seq_++;
    std::vector<at::Tensor> outs{output}, ins{input};
    std::vector<Call> calls;
    if (!gatherCall(output, input, calls)) return delegate("_allgather_base", output, input, opts);
    return run("all_gather_into_tensor", calls, outs, OpType::_ALLGATHER_BASE, opts.asyncOp, &ins);
  }

  c10::intrusive_ptr<Work> all_gather_single_coalesced(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) override {
    seq_++;
    std::vector<Call> calls;
    for (size_t i = 0; i < outputs.size() && i < inputs.size(); i++)
      if (!gatherCall(outputs[i], inputs[i], calls))
        return delegate("allgather_into_tensor_coalesced", outputs, inputs, opts);
    if (outputs.size() != inputs.size()) return delegate("allgather_into_tensor_coalesced", outputs, inputs, opts);
    return run("all_gather_into_tensor", calls, outputs, OpType::COALESCED, opts.asyncOp, &inputs);
  }

  // One input (several: gloo's form, every input of every rank in each output list, in
  // Python).
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    seq_++;
    if (inputs.size() != 1 || outputs.size() != 1 || opts.asyncOp) return delegate("allgather", outputs, inputs, opts);
    auto w = gatherEach(outputs, inputs);
    return w ? w : delegate("allgather", outputs, inputs, opts);
  }

  // torch's form: outputs[rank][i] receives inputs[i] of that rank.
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    seq_++;
    size_t n = size_t(getSize()), k = inputs.size();
    bool ok = k > 0 && outputs.size() == n && !opts.asyncOp;
    for (size_t r = 0; ok && r < n; r++) ok = outputs[r].size() == k;
    c10::intrusive_ptr<Work> w;
    if (ok) {
      std::vector<std::vector<at::Tensor>> perInput(k);
      for (size_t i = 0; i < k; i++)
        for (size_t r = 0; r < n; r++) perInput[i].push_back(outputs[r][i]);
      w = gatherEach(perInput, inputs);
    }
    return w ? w : delegate("allgather_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                 const c10d::ReduceScatterOptions& opts) override {
    seq_++;
    std::vector<Call> calls;
    std::vector<at::Tensor> outs{output}, ins{input};
    if (!scatterCall(output, input, opts, calls)) return delegate("_reduce_scatter_base", output, input, opts);
    return run("reduce_scatter_tensor", calls, outs, OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, &ins);
  }

  c10::intrusive_ptr<Work> reduce_scatter_single_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) override {
    seq_++;
    std::vector<Call> calls;
    bool ok = outputs.size() == inputs.size();
    for (size_t i = 0; ok && i < outputs.size(); i++) ok = scatterCall(outputs[i], inputs[i], opts, calls);
    if (!ok) return delegate("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
    return run("reduce_scatter_tensor", calls, outputs, OpType::COALESCED, opts.asyncOp, &inputs);
  }

  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    seq_++;
    // The inputs stacked into one buffer per output (a copy), then one call each.
    size_t n = size_t(getSize());
    int op = opOf(opts.reduceOp);
    bool ok = op >= 0 && !outputs.empty() && outputs.size() == inputs.size() && plain(outputs);
    for (size_t i = 0; ok && i < inputs.size(); i++) {
      ok = inputs[i].size() == n && dtypeOf(outputs[i]) >= 0;
      for (auto& t : inputs[i])
        ok = ok && t.device().is_cpu() && t.numel() == outputs[i].numel() &&
             t.scalar_type() == outputs[i].scalar_type();
    }
    if (!ok) return delegate("reduce_scatter", outputs, inputs, opts);
    std::vector<at::Tensor> stacked;
    std::vector<Call> calls;
    for (size_t i = 0; i < inputs.size(); i++) {
      std::vector<at::Tensor> flat;
      for (auto& t : inputs[i]) flat.push_back(t.reshape({-1}));
      stacked.push_back(at::stack(flat));
      calls.push_back({Kind::ReduceScatter, stacked.back().data_ptr(), outputs[i].data_ptr(),
                       size_t(outputs[i].numel()), dtypeOf(outputs[i]), op, 0});
    }
    return run("reduce_scatter", calls, outputs, OpType::REDUCE_SCATTER, opts.asyncOp, &stacked);
  }

  c10::intrusive_ptr<Work> all_to_all_single(at::Tensor& output, at::Tensor& input,
                                             std::vector<int64_t>& outSplits, std::vector<int64_t>& inSplits,
                                             const c10d::AllToAllOptions& opts) override {
    seq_++;
    // Equal blocks of dim 0 only (no split sizes, or all equal); the rest is the Python
    // backend's point-to-point group, which also refuses what torch's backends refuse (a
    // dim 0 that does not divide by the group size, a 0-dim tensor: not split by bytes).
    int64_t n = getSize();
    auto equal = [&](const std::vector<int64_t>& s, const at::Tensor& t) {
      if (t.dim() == 0 || t.size(0) % n != 0) return false;
      if (s.empty()) return true;
      if (int64_t(s.size()) != n) return false;
      for (auto v : s)
        if (v != s[0]) return false;
      return s[0] * n == t.size(0);
    };
    bool ok = plain(output) && plain(input) && output.scalar_type() == input.scalar_type() &&
              output.nbytes() == input.nbytes() && input.nbytes() % size_t(n) == 0 && equal(outSplits, output) &&
              equal(inSplits, input) && !overlap(output, input);
    if (!ok) return delegate("alltoall_base", output, input, outSplits, inSplits, opts);
    std::vector<Call> calls{{Kind::AllToAll, input.data_ptr(), output.data_ptr(), input.nbytes() / size_t(n),
                             oxcclUint8, oxcclSum, 0}};
    std::vector<at::Tensor> outs{output}, ins{input};
    return run("all_to_all_single", calls, outs, OpType::ALLTOALL_BASE, opts.asyncOp, &ins);
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    seq_++;
    std::vector<Call> calls{{Kind::Barrier, nullptr, nullptr, 0, oxcclUint8, oxcclSum, 0}};
    std::vector<at::Tensor> none;
    return run("barrier", calls, none, OpType::BARRIER, opts.asyncOp);
  }

  // -- delegated (the Python backend checks the root and the tensors before any data moves)
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    seq_++;
    return delegate("gather", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    seq_++;
    return delegate("scatter", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    seq_++;
    return delegate("alltoall", outputs, inputs, opts);
  }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    held_ = true;
    return delegate("send", tensors, dst, tag);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    held_ = true;
    return delegate("recv", tensors, src, tag);
  }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    held_ = true;
    return delegate("recv_anysource", tensors, tag);
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    py::gil_scoped_acquire gil;
    py_.attr("monitored_barrier")(opts, waitAllRanks);
  }
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire gil;
    py::object child = py_.attr("split")(store, ranks, opts);
    if (child.is_none()) return {};
    return wrap_(child).cast<c10::intrusive_ptr<Backend>>();
  }
  void shutdown() override {
    py::gil_scoped_acquire gil;
    py_.attr("shutdown")();
  }
  void abort() override {
    py::gil_scoped_acquire gil;
    py_.attr("abort")();
  }

  // The Python backend this one delegates to.
  py::object python() const { return py_; }

  // The handle of this group for the inference ops (inference.cpp).
  int64_t inferenceHandle() const { return handle_; }

 private:
  // Hands a call to the Python backend (which also checks what this file would not take).
  template <typename... Args>
  c10::intrusive_ptr<Work> delegate(const char* name, Args&... args) {
    py::gil_scoped_acquire gil;
    py::object w = py_.attr(name)(args...);
    if (w.is_none()) return {};
    return c10::make_intrusive<DelegatedWork>(std::move(w));
  }

  // Held point-to-point operations of the Python backend go before a collective of this file.
  void flushHeld() {
    if (!held_) return;
    py::gil_scoped_acquire gil;
    py_.attr("_flush_p2p")();
    held_ = false;
  }

  // inputs[i] of every rank into outputs[i] (one tensor per rank), each through a flat
  // buffer, then copied out: inline only (a queued call would need the copies after it).
  // Null when the form is not this file's (the Python backend takes it, or says why not).
  c10::intrusive_ptr<Work> gatherEach(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs) {
    size_t n = size_t(getSize()), total = 0;
    bool ok = outputs.size() == inputs.size() && plain(inputs);
    for (size_t i = 0; ok && i < inputs.size(); i++) {
      ok = outputs[i].size() == n;
      for (auto& o : outputs[i])
        ok = ok && o.defined() && o.device().is_cpu() && o.layout() == at::kStrided &&
             o.numel() == inputs[i].numel() && o.scalar_type() == inputs[i].scalar_type();
      total += inputs[i].nbytes() * n;
    }
    if (!ok || total > kInlineMaxBytes) return {};
    flushHeld();
    std::vector<at::Tensor> flat, result;
    for (size_t i = 0; i < inputs.size(); i++) {
      flat.push_back(at::empty({int64_t(n), inputs[i].numel()}, inputs[i].options()));
      check(issue({Kind::AllGather, inputs[i].data_ptr(), flat.back().data_ptr(), inputs[i].nbytes(), oxcclUint8,
                   oxcclSum, 0}));
    }
    for (size_t i = 0; i < inputs.size(); i++)
      for (size_t r = 0; r < n; r++) {
        outputs[i][r].copy_(flat[i][int64_t(r)].view(outputs[i][r].sizes()));
        result.push_back(outputs[i][r]);
      }
    return c10::make_intrusive<DoneWork>(std::move(result), OpType::ALLGATHER);
  }

  // A clear error, before any data moves, for a root outside the group.
  void checkRoot(const char* what, int64_t root) {
    if (root < 0 || root >= getSize())
      raise(oxcclInvalidArgument, "oxccl: rank " + std::to_string(getRank()) + ": " + what + ": root rank " +
                                      std::to_string(root) + " is not in this group of " + std::to_string(getSize()) +
                                      " (ranks 0 .. " + std::to_string(getSize() - 1) + ")");
  }

  // Whether any two of `ts` (contiguous) share a byte.
  static bool anyOverlap(const std::vector<at::Tensor>& ts) {
    if (ts.size() < 2) return false;
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;
    spans.reserve(ts.size());
    for (auto& t : ts)
      if (t.nbytes()) {
        auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
        spans.emplace_back(p, p + t.nbytes());
      }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); i++)
      if (spans[i].first < spans[i - 1].second) return true;
    return false;
  }

  static bool overlap(const at::Tensor& a, const at::Tensor& b) {
    auto pa = reinterpret_cast<uintptr_t>(a.data_ptr()), pb = reinterpret_cast<uintptr_t>(b.data_ptr());
    return a.nbytes() && b.nbytes() && pa < pb + b.nbytes() && pb < pa + a.nbytes();
  }

  // all_gather_into_tensor: separate, or in place as NCCL's (the input is this rank's block).
  bool gatherCall(at::Tensor& output, at::Tensor& input, std::vector<Call>& calls) {
    size_t n = size_t(getSize());
    if (!plain(output) || !plain(input) || output.scalar_type() != input.scalar_type() ||
        output.nbytes() != input.nbytes() * n)
      return false;
    auto* mine = static_cast<char*>(output.data_ptr()) + input.nbytes() * size_t(getRank());
    if (overlap(output, input) && mine != input.data_ptr()) return false;
    calls.push_back({Kind::AllGather, input.data_ptr(), output.data_ptr(), input.nbytes(), oxcclUint8, oxcclSum, 0});
    return true;
  }

  // reduce_scatter_tensor: separate, or in place as NCCL's (the output is this rank's block).
  bool scatterCall(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts,
                   std::vector<Call>& calls) {
    size_t n = size_t(getSize());
    int op = opOf(opts.reduceOp), dt = dtypeOf(output);
    if (op < 0 || dt < 0 || !plain(output) || !plain(input) || output.scalar_type() != input.scalar_type() ||
        input.nbytes() != output.nbytes() * n)
      return false;
    auto* mine = static_cast<char*>(input.data_ptr()) + output.nbytes() * size_t(getRank());
    if (overlap(output, input) && mine != output.data_ptr()) return false;
    calls.push_back({Kind::ReduceScatter, input.data_ptr(), output.data_ptr(), size_t(output.numel()), dt, op, 0});
    return true;
  }

  oxcclResult_t issue(const Call& c) {
    switch (c.kind) {
      case Kind::AllReduce:
        return api_->all_reduce(c.send, c.recv, c.count, oxcclDataType_t(c.dtype), oxcclRedOp_t(c.op), comm_);
      case Kind::Broadcast:
        return api_->broadcast(c.send, c.recv, c.count, oxcclDataType_t(c.dtype), c.root, comm_);
      case Kind::Reduce:
        return api_->reduce(c.send, c.recv, c.count, oxcclDataType_t(c.dtype), oxcclRedOp_t(c.op), c.root, comm_);
      case Kind::AllGather:
        return api_->all_gather(c.send, c.recv, c.count, oxcclDataType_t(c.dtype), comm_);
      case Kind::ReduceScatter:
        return api_->reduce_scatter(c.send, c.recv, c.count, oxcclDataType_t(c.dtype), oxcclRedOp_t(c.op), comm_);
      case Kind::AllToAll:
        return api_->all_to_all(c.send, c.recv, c.count, oxcclDataType_t(c.dtype), comm_);
      case Kind::Barrier:
        return api_->barrier(comm_);
    }
    return oxcclInternalError;
  }

  void check(oxcclResult_t r) {
    if (r != oxcclSuccess) raise(r, api_->get_last_error());
  }

  // Runs `calls` in order: inline when small and not asynchronous (`async`: torch's
  // opts.asyncOp, set by async_op=True and by torch's own callers such as DDP and functional
  // collectives), else queued as one group, so that an asynchronous call returns before the
  // peers arrive at every size (as gloo's). `extra`: tensors the queued calls read besides
  // `result` (inputs, temporaries), kept alive until they finish.
  c10::intrusive_ptr<Work> run(const char* what, std::vector<Call>& calls, std::vector<at::Tensor>& result,
                               OpType type, bool async, std::vector<at::Tensor>* extra = nullptr) {
    flushHeld();
    size_t bytes = 0;
    for (auto& t : result) bytes += t.nbytes();
    if (extra)
      for (auto& t : *extra) bytes = std::max(bytes, t.nbytes());
    if (!async && bytes <= kInlineMaxBytes) {
      for (auto& c : calls) check(issue(c));
      return c10::make_intrusive<DoneWork>(result, type);
    }
    check(api_->group_start());
    oxcclResult_t bad = oxcclSuccess;
    std::string msg;
    for (auto& c : calls) {
      oxcclResult_t r = issue(c);
      if (r != oxcclSuccess && bad == oxcclSuccess) {
        bad = r;
        msg = api_->get_last_error();
      }
    }
    oxcclWork_t w = nullptr;
    oxcclResult_t r = api_->group_end(&w);
    if (bad != oxcclSuccess) {
      // the calls accepted before run anyway (every rank makes the same checks)
      if (w) {
        api_->work_wait(w, timeout_s_);
        api_->work_free(w);
      }
      raise(bad, msg);
    }
    check(r);
    std::vector<at::Tensor> keep = result;
    if (extra) keep.insert(keep.end(), extra->begin(), extra->end());
    auto work = c10::make_intrusive<QueuedWork>(api_, w, std::move(keep), type, timeout_s_, getRank(), what);
    return work;
  }

  py::object py_;
  py::object wrap_;
  const oxcclApi_t* api_;
  oxcclComm_t comm_;
  std::atomic<double> timeout_s_;
  bool held_ = false;
  uint64_t seq_ = 0;  // collectives called (getSequenceNumberForGroup)
  std::shared_ptr<Group> group_;
  int64_t handle_ = 0;
};

// ------------------------------------------------------------------------------------------
// The shared-memory CPU allocator: CPU tensors of at least min_bytes come from the library's
// pool of shared buffers (oxcclMemAlloc), so that collectives on them (DDP's buckets, FSDP's
// flat buffers, made after init_process_group) take the shared-buffer path; smaller ones, and
// any allocation in a forked child, come from the allocator it replaced. Each DataPtr carries
// the deleter of the allocator that made it. Installed once per process and never removed
// or destroyed: storages keep a pointer to their allocator.
// ------------------------------------------------------------------------------------------
class ShmAllocator final : public c10::Allocator {
 public:
  ShmAllocator(c10::Allocator* prev, const oxcclApi_t* api, size_t min_bytes)
      : prev_(prev), prev_raw_(prev->raw_deleter()), api_(api), min_(min_bytes) {
    // A forked child allocates privately (see above); a flag its fork handler sets, where
    // getpid() would be a system call on every allocation.
    pthread_atfork(nullptr, nullptr, [] { forked.store(true, std::memory_order_relaxed); });
  }

  c10::DataPtr allocate(size_t n) override {
    if (n >= min_ && !forked.load(std::memory_order_relaxed)) {
      void* p = nullptr;
      if (api_->mem_alloc(&p, n) == oxcclSuccess) {
        return {p, p, &ShmAllocator::freeShared, c10::Device(c10::DeviceType::CPU)};
      }
      // The pool could not allocate (out of memory for memfds): private memory serves.
    }
    return prev_->allocate(n);
  }

  // raw_allocate/raw_deallocate: a pointer of either allocator.
  c10::DeleterFnPtr raw_deleter() const override { return prev_raw_ ? &ShmAllocator::freeAny : nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  size_t minBytes() const { return min_; }

  static ShmAllocator* installed;

 private:
  static void freeShared(void* p) { installed->api_->mem_free(p); }
  static void freeAny(void* p) {
    if (installed->api_->mem_free(p) != oxcclSuccess) installed->prev_raw_(p);
  }

  c10::Allocator* prev_;
  c10::DeleterFnPtr prev_raw_;
  const oxcclApi_t* api_;
  size_t min_;
  static std::atomic<bool> forked;  // this process is a fork of the one that installed it
};

std::atomic<bool> ShmAllocator::forked{false};

ShmAllocator* ShmAllocator::installed = nullptr;

// Installs the allocator (once; later calls change nothing) unless another one of a higher
// priority is set; returns whether it serves torch's CPU allocations.
bool installShmAllocator(const oxcclApi_t* api, size_t min_bytes) {
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  if (!ShmAllocator::installed) {
    auto* a = new ShmAllocator(c10::GetCPUAllocator(), api, min_bytes);  // never freed
    ShmAllocator::installed = a;
    c10::SetCPUAllocator(a, /*priority=*/0);
  }
  return c10::GetCPUAllocator() == ShmAllocator::installed;
}

}  // namespace oxccl_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using oxccl_torch::BackendOxcclCpp;
  m.doc() = "oxccl's torch backend in C++ (see oxccl/csrc/backend.cpp)";
  py::class_<BackendOxcclCpp, c10d::Backend, c10::intrusive_ptr<BackendOxcclCpp>>(m, "BackendOxcclCpp")
      .def(py::init([](py::object backend, uintptr_t comm, py::capsule api, double timeout_s, py::object wrap) {
             auto* table = static_cast<const oxcclApi_t*>(api.get_pointer());
             TORCH_CHECK(std::string(api.name()) == "oxccl._C_API", "oxccl: not the oxccl._C_API capsule");
             TORCH_CHECK(table->version == OXCCL_API_VERSION && table->size >= sizeof(oxcclApi_t),
                         "oxccl: the C++ torch backend was built for another oxccl (API version ",
                         OXCCL_API_VERSION, ", library ", table->version, "): rebuild it");
             if (!oxccl_torch::g_api) oxccl_torch::g_api = table;
             return c10::make_intrusive<BackendOxcclCpp>(std::move(backend), comm, table, timeout_s, std::move(wrap));
           }),
           py::arg("backend"), py::arg("comm"), py::arg("api"), py::arg("timeout_s"), py::arg("wrap"),
           "A C++ backend over `backend` (a BackendOxccl) and its communicator's C handle `comm`, "
           "which it owns; `wrap(child)` wraps the Python backend of a split group.")
      .def_property_readonly("python_backend", &BackendOxcclCpp::python)
      .def_property_readonly("inference_handle", &BackendOxcclCpp::inferenceHandle,
                             "This group's handle for the inference ops (torch.ops.oxccl.*).");
  oxccl_torch::defineInferenceFunctions(m);
  m.def(
      "drain_completions",
      [](double seconds) {
        py::gil_scoped_release nogil;  // completion tasks may run Python callbacks
        return oxccl_torch::completers().drain(seconds);
      },
      py::arg("seconds"),
      "Waits (at most `seconds`) until every queued call has completed and its future is marked; "
      "True if so. oxccl.torch calls it at exit.");
  m.def(
      "wait_now",
      [](const c10::intrusive_ptr<c10d::Work>& w) -> py::object {
        if (auto* q = dynamic_cast<oxccl_torch::QueuedWork*>(w.get())) return py::bool_(q->waitNow());
        if (dynamic_cast<oxccl_torch::DoneWork*>(w.get())) return py::bool_(true);
        if (auto* d = dynamic_cast<oxccl_torch::DelegatedWork*>(w.get())) return py::bool_(d->waitNow());
        return py::none();
      },
      py::arg("work"),
      "wait() with an expired timeout on a Work of this backend (True, or its error, or an "
      "oxccl TimeoutError if not finished); None for another Work.");
  m.def(
      "install_shm_allocator",
      [](py::capsule api, size_t min_bytes) {
        TORCH_CHECK(std::string(api.name()) == "oxccl._C_API", "oxccl: not the oxccl._C_API capsule");
        auto* table = static_cast<const oxcclApi_t*>(api.get_pointer());
        TORCH_CHECK(table->version == OXCCL_API_VERSION, "oxccl: the C++ torch backend was built for another oxccl: rebuild it");
        return oxccl_torch::installShmAllocator(table, min_bytes);
      },
      py::arg("api"), py::arg("min_bytes"),
      "Makes CPU tensors of at least min_bytes come from oxccl's pool of shared buffers (once per "
      "process); returns whether it is torch's CPU allocator now.");
  m.def(
      "shm_allocator_min_bytes",
      []() -> py::object {
        auto* a = oxccl_torch::ShmAllocator::installed;
        if (!a || c10::GetCPUAllocator() != a) return py::none();
        return py::int_(a->minBytes());
      },
      "The threshold of the installed shared-memory allocator, or None if it does not serve.");
  m.attr("API_VERSION") = OXCCL_API_VERSION;
}
