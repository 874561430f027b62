// oxccl's torch backend: a c10d::Backend whose calls go straight to the Rust library through
// its C ABI (oxccl.h), taken from the capsule oxccl._oxccl._C_API, so it is the library
// instance Python uses, on a communicator oxccl.torch made (its C handle, which this backend
// owns). It serves every call form torch sends, as gloo does, and raises a clear oxccl error
// before any data moves for what it cannot take: one dense tensor of a library dtype and op
// goes to the library as is; several tensors, non-contiguous, overlapping or lazily
// conjugated ones, complex, int16 and PREMUL_SUM reductions, sparse all_reduce go through
// temporaries and local steps (copied back once the call has finished); gather, scatter,
// all_to_all of lists and uneven all_to_all_single are the library's point-to-point
// collectives (oxcclP2p); isend/irecv are held and run as one point-to-point group.
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
// QueuedWork: `async_op=True` then `wait()` costs no thread hop in the common case. What a
// queued call does after the library (copies out of temporaries) runs once, with the
// caller's thread-local state (inference mode, grad mode), before its Work reports it done.
//
// Point-to-point (send, recv, recv_anysource) is held until one of its Works is waited on
// (or its future or is_completed asked for), the next collective starts, or the group shuts
// down (destroy_process_group, process exit: flush_held()); then every held operation runs as
// one oxcclP2p group (oxcclP2pUser), whose sends and receives progress together: send-first
// exchanges of any size complete and no set of ranks can wait on each other in a cycle. A
// batch_isend_irecv refused at one of its operations drops the ones of the batch held before
// it (torch issues a batch one operation at a time and raises without their Works).

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/utils/pybind.h>  // tensor and intrusive_ptr casters (not torch/extension.h: compiles in half the time)
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <frameobject.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstring>
#include <cxxabi.h>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <pthread.h>
#include <unistd.h>
#include <vector>

#include "groups.h"
#include "oxccl.h"

namespace py = pybind11;
using c10d::OpType;
using c10d::Work;

namespace oxccl_torch {

// Blocking collectives moving at most this many bytes (per rank) run inline on the caller's
// thread (the one copy of this threshold).
constexpr size_t kInlineMaxBytes = size_t(1) << 20;

const oxcclApi_t* g_api = nullptr;  // the library's table, set by the first backend

void defineInferenceFunctions(py::module_& m);  // inference.cpp

// ------------------------------------------------------------------------------------------
// Errors: the oxccl exception classes on the calling thread, a DistBackendError in futures.
// The class of a result code is oxccl._errors.for_result's, the one map of codes to classes
// (the Python binding raises through it too).
// ------------------------------------------------------------------------------------------
[[noreturn]] void raise(oxcclResult_t r, const std::string& msg) {
  py::gil_scoped_acquire gil;
  py::object cls = py::module_::import("oxccl._errors").attr("for_result")(int(r));
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

c10::TypePtr tensorListType() { return c10::ListType::create(c10::TensorType::get()); }

// The value of a call's future: its tensors, or (allgather with several inputs, as gloo's)
// a list per output list.
struct Value {
  std::vector<at::Tensor> flat;                  // Work::result()
  std::vector<std::vector<at::Tensor>> nested;  // the future's value when `isNested`
  bool isNested = false;

  Value() = default;
  Value(std::vector<at::Tensor> f) : flat(std::move(f)) {}  // NOLINT: implicit on purpose

  c10::TypePtr type() const {
    return isNested ? c10::TypePtr(c10::ListType::create(tensorListType())) : tensorListType();
  }
  c10::IValue ivalue() const {
    if (!isNested) return c10::IValue(flat);
    c10::List<c10::List<at::Tensor>> l;
    for (auto& v : nested) l.push_back(c10::List<at::Tensor>(v));
    return c10::IValue(l);
  }
};

c10::intrusive_ptr<c10::ivalue::Future> newFuture(const Value& v) {
  return c10::make_intrusive<c10::ivalue::Future>(v.type());
}

// What a call does after the library has finished: temporaries copied back into the
// caller's tensors (in order), then `then`; with the thread-local state of the caller
// (inference mode, grad mode: copies into inference tensors outside inference mode are
// refused), as gloo's work carries it.
struct Post {
  std::function<void()> first;  // before the copies back (a rank's own block into a temporary)
  std::vector<std::pair<at::Tensor, at::Tensor>> backs;  // (the caller's tensor, the temporary)
  std::function<void()> then;
  bool empty() const { return !first && backs.empty() && !then; }
  void run() {
    if (first) first();
    for (auto& b : backs) b.first.copy_(b.second);
    if (then) then();
  }
};

// ------------------------------------------------------------------------------------------
// Works.
// ------------------------------------------------------------------------------------------
// A call that has finished (it ran inline).
class DoneWork : public Work {
 public:
  DoneWork(Value value, OpType type) : Work(-1, type), value_(std::move(value)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return value_.flat; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = newFuture(value_);
    f->markCompleted(value_.ivalue());
    return f;
  }

 private:
  Value value_;
};

// What a queued call and its completion share. Two holders: the QueuedWork (`owned`) and the
// completion (`pending`: the library's callback, then the completion task it may hand over
// to); the last to let go deletes it, under `m`, and never on the library's stream thread (see
// QueuedWork::onComplete).
struct Completion {
  std::mutex m;
  std::condition_variable cv;  // `done` set
  bool done = false;
  bool noCallback = false;  // the library took no callback: `done` is never set
  oxcclResult_t code = oxcclSuccess;
  std::string msg;
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  bool marked = false;  // fut has been completed (by the completion task, wait or getFuture)
  std::vector<at::Tensor> keep;  // the call's tensors, alive until it has finished
  std::shared_ptr<void> hold;    // other memory the call uses (point-to-point operations)
  Post post;                     // run once after a successful call, before it reports done
  bool postRan = false;
  std::unique_ptr<at::ThreadLocalState> tls;  // the caller's, for `post`
  Value value;          // the future's value
  bool owned = true;    // the QueuedWork still exists
  bool pending = true;  // the completion (callback or its task) still holds this
};

// Runs a finished call's post step once (under c->m: a second thread asking waits for it);
// its error becomes the call's. `finished`: the library has said the call finished, so its
// callback (which sets `done` right after) is waited for.
void runPost(Completion* c, bool finished = true) {
  std::unique_lock<std::mutex> lock(c->m);
  if (finished) c->cv.wait(lock, [c] { return c->done || c->noCallback; });
  if (c->postRan || !c->done) return;
  c->postRan = true;
  if (c->code != oxcclSuccess || c->post.empty()) return;
  try {
    if (c->tls) {
      at::ThreadLocalStateGuard guard(*c->tls);
      c->post.run();
    } else {
      c->post.run();
    }
  } catch (const std::exception& e) {
    c->code = oxcclInternalError;
    c->msg = std::string("oxccl: copying the result out of a temporary failed: ") + e.what();
  }
  c->post = Post();  // lets go of the temporaries
}

void completeFuture(const c10::intrusive_ptr<c10::ivalue::Future>& fut, oxcclResult_t code,
                    const std::string& msg, const Value& value) {
  if (code == oxcclSuccess) {
    fut->markCompleted(value.ivalue());
  } else {
    fut->setError(std::make_exception_ptr(c10::DistBackendError(msg)));
  }
}

// A call queued on the communicator's stream.
class QueuedWork : public Work {
 public:
  QueuedWork(const oxcclApi_t* api, oxcclWork_t w, Value value, std::vector<at::Tensor> keep, Post post,
             std::shared_ptr<void> hold, OpType type, double timeout_s, int rank, std::string what)
      : Work(rank, type), api_(api), w_(w), value_(std::move(value)), timeout_s_(timeout_s), rank_(rank),
        what_(std::move(what)), c_(new Completion()) {
    c_->keep = std::move(keep);
    c_->hold = std::move(hold);
    c_->value = value_;
    if (!post.empty()) {
      c_->post = std::move(post);
      c_->tls = std::make_unique<at::ThreadLocalState>();
    }
    completers().begin();
    oxcclResult_t r = api_->work_on_complete(w_, &QueuedWork::onComplete, c_);
    if (r != oxcclSuccess) {  // cannot happen for a fresh work; keep it and its tensors for good
      c_ = new Completion();
      c_->pending = false;
      c_->noCallback = true;
      completers().end();
    }
  }

  ~QueuedWork() override {
    api_->work_free(w_);
    std::vector<at::Tensor> keep;
    std::shared_ptr<void> hold;
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    bool last;
    runPost(c_, false);  // a finished call dropped without a wait still writes its result
    {
      std::lock_guard<std::mutex> lock(c_->m);
      c_->owned = false;
      last = !c_->pending;
      if (last) {  // the call has finished and its completion let go: let go here
        keep.swap(c_->keep);
        hold.swap(c_->hold);
        fut = std::move(c_->fut);
      }
    }
    if (last) delete c_;  // else the completion task deletes it
  }

  bool isCompleted() override {
    int done = 0;
    api_->work_test(w_, &done);
    if (done) runPost(c_);
    return done != 0;
  }

  bool isSuccess() const override {
    int done = 0;
    if (api_->work_test(w_, &done) != oxcclSuccess || !done) return false;
    runPost(c_);
    std::lock_guard<std::mutex> lock(c_->m);
    return c_->code == oxcclSuccess;
  }

  std::exception_ptr exception() const override {
    int done = 0;
    oxcclResult_t r = api_->work_test(w_, &done);
    if (!done) return nullptr;
    if (r != oxcclSuccess) return std::make_exception_ptr(c10::DistBackendError(api_->get_last_error()));
    runPost(c_);
    std::lock_guard<std::mutex> lock(c_->m);
    if (c_->code != oxcclSuccess) return std::make_exception_ptr(c10::DistBackendError(c_->msg));
    return nullptr;
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
      afterSuccess();
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
    afterSuccess();
    return true;
  }

  std::vector<at::Tensor> result() override { return value_.flat; }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    bool now = false;
    {
      std::lock_guard<std::mutex> lock(c_->m);
      if (!c_->fut) c_->fut = newFuture(value_);
      fut = c_->fut;
      now = c_->done && !c_->marked;
    }
    if (now) {
      runPost(c_);
      oxcclResult_t code;
      std::string msg;
      {
        std::lock_guard<std::mutex> lock(c_->m);
        if (c_->marked) return fut;
        c_->marked = true;
        code = c_->code;
        msg = c_->msg;
      }
      completeFuture(fut, code, msg, value_);
    } else {
      settleIfDone();  // finished, its completion task not yet run: done now all the same
    }
    return fut;
  }

 private:
  // After the library reported success: the post step, whose failure is raised.
  void afterSuccess() {
    runPost(c_);
    oxcclResult_t code;
    std::string msg;
    {
      std::lock_guard<std::mutex> lock(c_->m);
      code = c_->code;
      msg = c_->msg;
    }
    if (code != oxcclSuccess) raise(code, msg);
  }

  // Completes the future now (once) if it exists and the library says the call has finished,
  // without waiting for the completion task: after a wait() that returned, or when a finished
  // call's future is asked for, it is done (as gloo's). The completion task then finds it
  // marked and only lets go of the tensors.
  void settleIfDone() {
    int done = 0;
    oxcclResult_t r = api_->work_test(w_, &done);
    if (!done) return;
    std::string msg = r == oxcclSuccess ? std::string() : std::string(api_->get_last_error());
    {
      std::lock_guard<std::mutex> lock(c_->m);
      if (!c_->fut || c_->marked || !c_->done) return;
    }
    runPost(c_);
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    {
      std::lock_guard<std::mutex> lock(c_->m);
      if (!c_->fut || c_->marked) return;
      c_->marked = true;
      fut = c_->fut;
      if (r == oxcclSuccess && c_->code != oxcclSuccess) {
        r = c_->code;
        msg = c_->msg;
      }
    }
    completeFuture(fut, r, msg, value_);
  }

  // The library's completion callback: on the thread that ran the call (its stream thread, or
  // a thread in wait() that ran it). When nothing is to be done but letting go of the tensors
  // and the QueuedWork still exists, the QueuedWork does that later, on its own thread: no
  // hand-over. Otherwise (a future to complete, whose then() callbacks may run collectives;
  // or the QueuedWork gone, so this is the last holder of tensors whose release may need the
  // GIL, and of a post step still to run) a completion thread does it: never the stream thread.
  static void onComplete(void* arg, oxcclResult_t code) {
    auto* c = static_cast<Completion*>(arg);
    std::string msg = code == oxcclSuccess ? std::string() : std::string(g_api->get_last_error());
    bool handOver;
    {
      std::lock_guard<std::mutex> lock(c->m);
      c->done = true;
      c->code = code;
      c->msg = msg;
      c->cv.notify_all();
      handOver = !c->owned || (c->fut && !c->marked);
      if (!handOver) c->pending = false;  // the QueuedWork lets go (and deletes c) on its thread
    }
    if (!handOver) {  // c may be gone already: not touched again
      completers().end();
      return;
    }
    completers().push([c] {
      struct Ended {  // counted done once the tensors and the future are let go of
        ~Ended() { completers().end(); }
      } ended;
      runPost(c);
      c10::intrusive_ptr<c10::ivalue::Future> fut;
      std::vector<at::Tensor> keep;
      std::shared_ptr<void> hold;
      c10::intrusive_ptr<c10::ivalue::Future> drop;
      Value value;
      oxcclResult_t code;
      std::string msg;
      bool last;
      {
        std::lock_guard<std::mutex> lock(c->m);
        if (c->fut && !c->marked) {
          c->marked = true;
          fut = c->fut;
          value = c->value;
        }
        code = c->code;
        msg = c->msg;
        keep.swap(c->keep);
        hold.swap(c->hold);
        c->pending = false;
        last = !c->owned;
        if (last) drop = std::move(c->fut);
      }
      if (fut) completeFuture(fut, code, msg, value);
      if (last) delete c;
    });
  }

  const oxcclApi_t* api_;
  oxcclWork_t w_;
  Value value_;
  double timeout_s_;
  int rank_;
  std::string what_;
  Completion* c_;
};

// ------------------------------------------------------------------------------------------
// Tensors and options: the one map of torch dtypes and ops to oxccl.h's enums.
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

const char* kReducedTypes =
    "float32, float64, float16, bfloat16, int8, uint8, uint16, int32, uint32, int64, uint64, bool; "
    "int16 and complex through a temporary";

// A reduction: oxccl's op, or PREMUL_SUM (each rank's input times its own factor, then
// summed: the factor is applied here, to a temporary, and the library sums).
struct Op {
  int code = oxcclSum;  // oxcclRedOp_t (oxcclSum for PREMUL_SUM)
  bool premul = false;
  double factor = 1.0;
  const char* name = "SUM";
};

// oxccl's op of a ReduceOp, or -1 (PREMUL_SUM and what oxccl lacks), for the direct paths.
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

const char* opName(int code) {
  static const char* names[] = {"SUM", "PRODUCT", "MAX", "MIN", "AVG", "BAND", "BOR", "BXOR"};
  return code >= 0 && code < 8 ? names[code] : "?";
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

std::string shapeOf(const at::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + (t.dim() == 1 ? ",)" : ")");
}

// torch's Python name of a tensor's dtype ("torch.float32", "torch.float8_e4m3fn").
std::string dtypeName(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: {  // Bool, BFloat16, UInt16, Float8_e4m3fn, ...: the same name in lower case
      std::string n = c10::toString(t.scalar_type());
      for (auto& ch : n) ch = char(std::tolower(static_cast<unsigned char>(ch)));
      return "torch." + n;
    }
  }
}

// The indices of the tensors of `ts` whose bytes (their spans, strides included) overlap
// those of one before them in address order.
std::vector<bool> overlapping(const std::vector<at::Tensor>& ts) {
  std::vector<bool> out(ts.size(), false);
  std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> spans;
  for (size_t i = 0; i < ts.size(); i++) {
    auto& t = ts[i];
    if (!t.defined() || t.numel() == 0 || t.layout() != at::kStrided) continue;
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); d++) last += (t.size(d) - 1) * t.stride(d);
    auto p = reinterpret_cast<uintptr_t>(t.data_ptr());
    spans.emplace_back(p, p + uintptr_t(last + 1) * t.element_size(), i);
  }
  std::sort(spans.begin(), spans.end());
  uintptr_t end = 0;
  for (size_t k = 0; k < spans.size(); k++) {
    if (k > 0 && std::get<0>(spans[k]) < end) out[std::get<2>(spans[k])] = true;
    end = std::max(end, std::get<1>(spans[k]));
  }
  return out;
}

bool overlap(const at::Tensor& a, const at::Tensor& b) {
  auto o = overlapping({a, b});
  return o[0] || o[1];
}

// One library call.
enum class Kind { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, AllToAll, Barrier, P2p };

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;  // all_gather: per rank (sendcount); reduce_scatter: recvcount; all_to_all: per peer
  int dtype;
  int op;
  int root;
  std::vector<oxcclP2pOp_t>* ops = nullptr;  // Kind::P2p: its operations (held by the call's owner)
  int p2p = oxcclP2pUser;
};

// ------------------------------------------------------------------------------------------
// Held point-to-point operations, shared by a backend and their Works.
// ------------------------------------------------------------------------------------------
struct HeldJob {
  std::string what;
  std::vector<at::Tensor> tensors;
  bool held = true;
  bool failed = false;  // refused when flushed, or dropped with its batch
  oxcclResult_t code = oxcclSuccess;
  std::string msg;
  c10::intrusive_ptr<QueuedWork> batch;              // the group it ran in, once flushed
  std::shared_ptr<std::vector<oxcclP2pOp_t>> ops;  // that group's operations (their sources)
  size_t index = 0;                                  // its (last) operation there
};

class Held {
 public:
  Held(std::shared_ptr<Group> group, double timeout_s) : group_(std::move(group)), timeout_s_(timeout_s) {}

  void setTimeout(double s) { timeout_s_ = s; }

  // Holds one operation; `batch`: the batch_isend_irecv it belongs to (null: none).
  void hold(const std::shared_ptr<HeldJob>& job, const std::vector<oxcclP2pOp_t>& ops, size_t batch) {
    std::lock_guard<std::mutex> lock(m_);
    job->index = ops_.size() + ops.size() - 1;
    jobBatch_.emplace_back(batch, ops_.size());
    ops_.insert(ops_.end(), ops.begin(), ops.end());
    tensors_.insert(tensors_.end(), job->tensors.begin(), job->tensors.end());
    jobs_.push_back(job);
  }

  // Drops the held operations of batch `batch` (torch raised at one of its operations
  // without returning the Works of those before it: a retry would send them twice).
  void dropBatch(size_t batch, const std::string& why) {
    std::lock_guard<std::mutex> lock(m_);
    while (!jobs_.empty() && jobBatch_.back().first == batch) {
      auto job = jobs_.back();
      size_t first = jobBatch_.back().second;
      jobs_.pop_back();
      jobBatch_.pop_back();
      ops_.resize(first);
      tensors_.resize(std::min(tensors_.size(), first));
      job->held = false;
      job->failed = true;
      job->code = oxcclInvalidArgument;
      job->msg = why;
    }
  }

  bool any() {
    std::lock_guard<std::mutex> lock(m_);
    return !ops_.empty();
  }

  // Runs every held operation as one queued point-to-point group.
  void flush() {
    std::lock_guard<std::mutex> lock(m_);
    if (ops_.empty()) return;
    auto ops = std::make_shared<std::vector<oxcclP2pOp_t>>(std::move(ops_));
    std::vector<at::Tensor> tensors = std::move(tensors_);
    std::vector<std::shared_ptr<HeldJob>> jobs = std::move(jobs_);
    ops_.clear();
    tensors_.clear();
    jobs_.clear();
    jobBatch_.clear();
    const oxcclApi_t* api = group_->api;
    oxcclWork_t w = nullptr;
    oxcclResult_t r = api->group_start();
    oxcclResult_t bad = api->p2p(ops->data(), ops->size(), oxcclP2pUser, group_->comm);
    std::string msg = bad == oxcclSuccess ? std::string() : std::string(api->get_last_error());
    r = api->group_end(&w);
    if (bad == oxcclSuccess && r != oxcclSuccess) {
      bad = r;
      msg = api->get_last_error();
    }
    if (bad != oxcclSuccess || !w) {
      if (w) api->work_free(w);
      for (auto& j : jobs) {
        j->held = false;
        j->failed = true;
        j->code = bad == oxcclSuccess ? oxcclInternalError : bad;
        j->msg = msg;
      }
      return;
    }
    auto batch = c10::make_intrusive<QueuedWork>(api, w, Value(tensors), tensors, Post(), ops, OpType::SEND,
                                                 timeout_s_, group_->rank, "send/recv");
    for (auto& j : jobs) {
      j->batch = batch;
      j->ops = ops;
      j->held = false;
    }
  }

 private:
  std::mutex m_;
  std::shared_ptr<Group> group_;
  std::atomic<double> timeout_s_;
  std::vector<oxcclP2pOp_t> ops_;
  std::vector<at::Tensor> tensors_;
  std::vector<std::shared_ptr<HeldJob>> jobs_;
  std::vector<std::pair<size_t, size_t>> jobBatch_;  // per job: its batch (0: none), its first op
};

// Every live backend's held operations, for flush_held() at exit.
std::mutex g_helds_m;
std::vector<std::weak_ptr<Held>> g_helds;

// The Work of a held send or recv: waiting on it (or asking for its future or whether it
// has completed) first runs every held operation.
class HeldWork : public Work {
 public:
  HeldWork(std::shared_ptr<Held> held, std::shared_ptr<HeldJob> job, OpType type, int rank)
      : Work(rank, type), held_(std::move(held)), job_(std::move(job)) {}

  bool isCompleted() override {
    auto b = flushed();
    return !b || b->isCompleted();
  }
  bool isSuccess() const override {
    auto b = const_cast<HeldWork*>(this)->flushed();
    return b && b->isSuccess();
  }
  std::exception_ptr exception() const override {
    auto b = const_cast<HeldWork*>(this)->flushed();
    if (!b) return std::make_exception_ptr(c10::DistBackendError(job_->msg));
    return b->exception();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    auto b = need();
    return b->wait(timeout);
  }
  bool waitNow() { return need()->waitNow(); }
  std::vector<at::Tensor> result() override { return job_->tensors; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto b = flushed();
    Value v(job_->tensors);
    if (!b) {
      auto f = newFuture(v);
      f->setError(std::make_exception_ptr(c10::DistBackendError(job_->msg)));
      return f;
    }
    auto tensors = job_->tensors;
    return b->getFuture()->then([tensors](c10::ivalue::Future&) { return c10::IValue(tensors); }, v.type());
  }
  // The rank a finished recv's message came from (what dist.recv returns).
  int sourceRank() const override {
    auto b = const_cast<HeldWork*>(this)->need();
    if (!b->isCompleted() || !job_->ops)
      raise(oxcclInvalidArgument, "oxccl: " + job_->what + ": not finished, so no source rank");
    int src = (*job_->ops)[job_->index].source;
    if (src < 0) raise(oxcclInvalidArgument, "oxccl: " + job_->what + ": not a finished recv, so no source rank");
    return src;
  }

 private:
  // The group this operation ran in (flushing the held ones first), or null when it was
  // refused or dropped.
  c10::intrusive_ptr<QueuedWork> flushed() {
    held_->flush();  // under the Held's lock: the job's fields are settled after it
    return job_->failed ? c10::intrusive_ptr<QueuedWork>() : job_->batch;
  }
  c10::intrusive_ptr<QueuedWork> need() {
    auto b = flushed();
    if (!b) raise(job_->code, job_->msg);
    return b;
  }

  std::shared_ptr<Held> held_;
  std::shared_ptr<HeldJob> job_;
};

// The batch_isend_irecv frame the current send or recv was issued from (torch issues a
// batch's operations one by one without coalescing), as a new reference, or null.
py::object batchFrame() {
  py::gil_scoped_acquire gil;
  PyFrameObject* f = PyEval_GetFrame();
  if (!f) return py::object();
  py::object cur = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(f));
  for (int i = 0; i < 10 && cur; i++) {
    auto* fo = reinterpret_cast<PyFrameObject*>(cur.ptr());
    py::object code = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(PyFrame_GetCode(fo)));
    if (py::str(code.attr("co_name")).cast<std::string>() == "batch_isend_irecv") {
      py::object globals = py::reinterpret_steal<py::object>(PyFrame_GetGlobals(fo));
      py::object name = globals.attr("get")("__name__");
      if (!name.is_none() && name.cast<std::string>() == "torch.distributed.distributed_c10d") return cur;
    }
    PyFrameObject* back = PyFrame_GetBack(fo);
    cur = back ? py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(back)) : py::object();
  }
  return py::object();
}

// ------------------------------------------------------------------------------------------
// The backend.
// ------------------------------------------------------------------------------------------
// A tensor as the library takes it (`t`, maybe a temporary) and its oxccl type.
struct Lib {
  at::Tensor t;
  int dt;
};

class BackendOxcclCpp : public c10d::Backend {
 public:
  BackendOxcclCpp(uintptr_t comm, const oxcclApi_t* api, int rank, int size, double timeout_s,
                  c10::intrusive_ptr<c10d::Store> store, py::object state)
      : Backend(rank, size), state_(std::move(state)), store_(std::move(store)), api_(api),
        comm_(reinterpret_cast<oxcclComm_t>(comm)), timeout_s_(timeout_s) {
    // The group owns the communicator's handle; the inference ops reach it by its handle.
    group_ = std::make_shared<Group>(api_, comm_, rank, size);
    handle_ = registerGroup(group_);
    held_ = std::make_shared<Held>(group_, timeout_s);
    std::lock_guard<std::mutex> lock(g_helds_m);
    g_helds.erase(std::remove_if(g_helds.begin(), g_helds.end(), [](auto& w) { return w.expired(); }), g_helds.end());
    g_helds.push_back(held_);
  }

  ~BackendOxcclCpp() override {
    unregisterGroup(handle_);
    held_.reset();
    group_.reset();  // the communicator's handle goes with the last call holding the group
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      state_ = py::object();
      batch_ = py::object();
    } else {
      state_.release();
      batch_.release();
    }
  }

  const std::string getBackendName() const override { return "oxccl"; }
  bool supportsSplitting() const override { return true; }
  bool supportsCoalescing() const override { return false; }

  // dist.set_timeout (ProcessGroup.set_timeout): the bound on every later call of the group
  // (the communicator's timeout), and the group's timeout for the groups made from it.
  void setTimeout(std::chrono::milliseconds timeout) override {
    if (timeout.count() <= 0)
      invalid("set_timeout: the timeout (" + std::to_string(timeout.count()) + " ms) is not positive");
    check(api_->comm_set_timeout(comm_, timeout.count() / 1000.0));
    timeout_s_ = timeout.count() / 1000.0;
    held_->setTimeout(timeout_s_);
  }

  // The group's options (torch asks for them, e.g. to split the group).
  c10::intrusive_ptr<Options> getBackendOptions() override {
    double t = timeout_s_;
    auto ms = t > 0 ? std::chrono::milliseconds(int64_t(t * 1000)) : std::chrono::milliseconds(30 * 60 * 1000);
    return c10::make_intrusive<Options>("oxccl", ms);
  }

  // Sequence numbers, as gloo's: every collective call counts, from 0 on every rank (torch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL compares them across ranks). Point-to-point calls do not.
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  void setSequenceNumberForGroup() override {}  // nothing to agree on: 0 everywhere

  // -- all_reduce -------------------------------------------------------------------------
  // One dense tensor of a library dtype and op straight to the library; the other forms:
  // allreduceForms.
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    seq_++;
    int op = opOf(opts.reduceOp);
    if (tensors.size() == 1 && op >= 0 && plain(tensors[0])) {
      auto& t = tensors[0];
      int dt = dtypeOf(t);
      if (dt >= 0) {
        std::vector<Call> calls{{Kind::AllReduce, t.data_ptr(), t.data_ptr(), size_t(t.numel()), dt, op, 0}};
        return run("all_reduce", calls, tensors, OpType::ALLREDUCE, opts.asyncOp);
      }
    }
    return allreduceForms(tensors, opts);
  }

  c10::intrusive_ptr<Work> allreduce_sparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override {
    seq_++;
    return allreduceForms(tensors, opts);
  }

  // Each tensor reduced on its own. A tensor that shares memory with an earlier one of the
  // list is reduced from a copy taken before the call (gloo's result: as if every position
  // were reduced once).
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) override {
    seq_++;
    nonempty("allreduce_coalesced", tensors.size());
    Op o = reduction(opts.reduceOp);
    for (auto& t : tensors) checkTensor(t, "allreduce_coalesced");
    Post post;
    std::vector<Call> calls;
    std::vector<at::Tensor> extra;
    auto aliased = overlapping(tensors);
    for (size_t i = 0; i < tensors.size(); i++) {
      auto& t = tensors[i];
      at::Tensor src = t;
      if (aliased[i]) {
        src = t.clone(at::MemoryFormat::Contiguous);
        Lib l = dense(src, "all_reduce output", &o, &post, true, true);
        post.backs.emplace_back(t, src);
        calls.push_back(reduceCall(Kind::AllReduce, l, o, 0));
        extra.push_back(l.t);
      } else {
        Lib l = dense(t, "all_reduce output", &o, &post, true, true);
        calls.push_back(reduceCall(Kind::AllReduce, l, o, 0));
        extra.push_back(l.t);
      }
    }
    return run("all_reduce", calls, tensors, OpType::ALLREDUCE_COALESCED, opts.asyncOp, extra, std::move(post));
  }

  // -- broadcast, reduce ------------------------------------------------------------------
  // One tensor; several: gloo's form, the root's tensors[rootTensor] into every one.
  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override {
    seq_++;
    checkRoot("broadcast", opts.rootRank);
    if (tensors.size() == 1 && opts.rootTensor == 0 && plain(tensors[0])) {
      auto& t = tensors[0];
      std::vector<Call> calls{{Kind::Broadcast, t.data_ptr(), t.data_ptr(), t.nbytes(), oxcclUint8, oxcclSum,
                               int(opts.rootRank)}};
      return run("broadcast", calls, tensors, OpType::BROADCAST, opts.asyncOp);
    }
    nonempty("broadcast", tensors.size());
    if (opts.rootTensor < 0 || opts.rootTensor >= int64_t(tensors.size()))
      invalid("broadcast: root tensor " + std::to_string(opts.rootTensor) + " is not in the list of " +
              std::to_string(tensors.size()) + " tensors");
    if (tensors.size() > 1) sameKind("broadcast", tensors);
    Post post;
    auto src = tensors[opts.rootTensor];
    bool isRoot = opts.rootRank == getRank();
    Lib l = dense(src, "broadcast output", nullptr, &post, isRoot, false);
    std::vector<Call> calls{{Kind::Broadcast, l.t.data_ptr(), l.t.data_ptr(), l.t.nbytes(), oxcclUint8, oxcclSum,
                             int(opts.rootRank)}};
    if (tensors.size() > 1) {
      auto all = tensors;
      int64_t rt = opts.rootTensor;
      post.then = [all, rt, src] {
        for (size_t i = 0; i < all.size(); i++)
          if (int64_t(i) != rt) all[i].copy_(src);
      };
    }
    return run("broadcast", calls, tensors, OpType::BROADCAST, opts.asyncOp, {l.t}, std::move(post));
  }

  // The root's tensor becomes the reduction; the others' are left as they were.
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    seq_++;
    checkRoot("reduce", opts.rootRank);
    int op = opOf(opts.reduceOp);
    if (tensors.size() == 1 && opts.rootTensor == 0 && op >= 0 && plain(tensors[0]) && dtypeOf(tensors[0]) >= 0) {
      auto& t = tensors[0];
      std::vector<Call> calls{{Kind::Reduce, t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeOf(t), op,
                               int(opts.rootRank)}};
      return run("reduce", calls, tensors, OpType::REDUCE, opts.asyncOp);
    }
    if (tensors.size() != 1) invalid("reduce: requires exactly one tensor, got " + std::to_string(tensors.size()));
    if (opts.rootTensor != 0)
      invalid("reduce: root tensor " + std::to_string(opts.rootTensor) + " is not in the list of 1 tensor");
    Op o = reduction(opts.reduceOp);
    Post post;
    bool isRoot = opts.rootRank == getRank();
    // A temporary is copied back on the root only: the others' tensors stay as they were.
    Lib l = dense(tensors[0], "reduce output", &o, isRoot ? &post : nullptr, true, true);
    std::vector<Call> calls{reduceCall(Kind::Reduce, l, o, int(opts.rootRank))};
    return run("reduce", calls, tensors, OpType::REDUCE, opts.asyncOp, {l.t}, std::move(post));
  }

  // -- all_gather --------------------------------------------------------------------------
  c10::intrusive_ptr<Work> all_gather_single(at::Tensor& output, at::Tensor& input,
                                             const c10d::AllgatherOptions& opts) override {
    return _allgather_base(output, input, opts);
  }

  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    seq_++;
    std::vector<at::Tensor> outs{output}, ins{input};
    std::vector<Call> calls;
    Post post;
    std::vector<at::Tensor> extra{input};
    gatherInto(output, input, calls, post, extra);
    return run("all_gather_into_tensor", calls, outs, OpType::_ALLGATHER_BASE, opts.asyncOp, extra, std::move(post));
  }

  c10::intrusive_ptr<Work> all_gather_single_coalesced(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) override {
    return allgather_into_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) override {
    seq_++;
    if (outputs.size() != inputs.size())
      invalid("all_gather_into_tensor: " + std::to_string(outputs.size()) + " outputs for " +
              std::to_string(inputs.size()) + " inputs");
    std::vector<Call> calls;
    Post post;
    std::vector<at::Tensor> extra = inputs;
    for (size_t i = 0; i < outputs.size(); i++) gatherInto(outputs[i], inputs[i], calls, post, extra);
    return run("all_gather_into_tensor", calls, outputs, OpType::COALESCED, opts.asyncOp, extra, std::move(post));
  }

  // outputs[0][r] becomes rank r's input; several inputs (gloo's form): every output list
  // gets input j of rank r at r * k + j, and the future's value is the output lists.
  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    seq_++;
    size_t n = size_t(getSize()), k = inputs.size();
    nonempty("allgather", k);
    if (outputs.size() != k)
      invalid("allgather: " + std::to_string(outputs.size()) + " output lists for " + std::to_string(k) +
              " input tensors");
    if (k == 1) return gatherEach("all_gather", outputs, inputs, opts.asyncOp, OpType::ALLGATHER);
    sameKind("allgather", inputs);
    auto& first = inputs[0];
    for (auto& outs : outputs) {
      if (outs.size() != k * n)
        invalid("allgather: " + std::to_string(outs.size()) + " tensors in an output list, expected " +
                std::to_string(k) + " inputs x " + std::to_string(n) + " ranks");
      for (auto& o : outs) {
        checkTensor(o, "allgather output");
        if (o.numel() != first.numel() || o.scalar_type() != first.scalar_type())
          invalid("allgather: every output tensor must have the inputs' size and dtype");
      }
    }
    std::vector<at::Tensor> rows;
    for (auto& t : inputs) rows.push_back(t.reshape({-1}));
    auto send = at::stack(rows);
    auto flat = at::empty({int64_t(n * k), first.numel()}, first.options().memory_format(at::MemoryFormat::Contiguous));
    Post post;
    auto outs = outputs;
    post.then = [outs, flat] {
      for (auto& list : outs)
        for (size_t i = 0; i < list.size(); i++) list[i].copy_(flat[int64_t(i)].view(list[i].sizes()));
    };
    Lib s = dense(send, "allgather input", nullptr, nullptr, true, false);
    std::vector<Call> calls{{Kind::AllGather, s.t.data_ptr(), flat.data_ptr(), s.t.nbytes(), oxcclUint8, oxcclSum, 0}};
    Value v;
    v.isNested = true;
    v.nested = outputs;
    for (auto& l : outputs) v.flat.insert(v.flat.end(), l.begin(), l.end());
    return run("all_gather", calls, std::move(v), OpType::ALLGATHER, opts.asyncOp, {s.t, flat}, std::move(post));
  }

  // torch's form: outputs[rank][i] receives inputs[i] of that rank.
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    seq_++;
    size_t n = size_t(getSize()), k = inputs.size();
    nonempty("allgather_coalesced", k);
    if (outputs.size() != n)
      invalid("allgather_coalesced: " + std::to_string(outputs.size()) + " output lists for a group of " +
              std::to_string(n) + " (one per rank)");
    for (size_t r = 0; r < n; r++)
      if (outputs[r].size() != k)
        invalid("allgather_coalesced: output list " + std::to_string(r) + " has " + std::to_string(outputs[r].size()) +
                " tensors for " + std::to_string(k) + " inputs");
    std::vector<std::vector<at::Tensor>> perInput(k);
    for (size_t i = 0; i < k; i++)
      for (size_t r = 0; r < n; r++) perInput[i].push_back(outputs[r][i]);
    return gatherEach("all_gather_coalesced", perInput, inputs, opts.asyncOp, OpType::ALLGATHER_COALESCED);
  }

  // -- reduce_scatter ----------------------------------------------------------------------
  c10::intrusive_ptr<Work> reduce_scatter_single(at::Tensor& output, at::Tensor& input,
                                                 const c10d::ReduceScatterOptions& opts) override {
    return _reduce_scatter_base(output, input, opts);
  }

  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    seq_++;
    std::vector<Call> calls;
    std::vector<at::Tensor> outs{output}, extra{input};
    Post post;
    Op o = opOf(opts.reduceOp) >= 0 ? simpleOp(opts.reduceOp) : reduction(opts.reduceOp);
    scatterFrom(output, input, o, calls, post, extra);
    return run("reduce_scatter_tensor", calls, outs, OpType::_REDUCE_SCATTER_BASE, opts.asyncOp, extra,
               std::move(post));
  }

  c10::intrusive_ptr<Work> reduce_scatter_single_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) override {
    return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) override {
    seq_++;
    if (outputs.size() != inputs.size())
      invalid("reduce_scatter_tensor: " + std::to_string(outputs.size()) + " outputs for " +
              std::to_string(inputs.size()) + " inputs");
    Op o = reduction(opts.reduceOp);
    std::vector<Call> calls;
    std::vector<at::Tensor> extra = inputs;
    Post post;
    for (size_t i = 0; i < outputs.size(); i++) scatterFrom(outputs[i], inputs[i], o, calls, post, extra);
    return run("reduce_scatter_tensor", calls, outputs, OpType::COALESCED, opts.asyncOp, extra, std::move(post));
  }

  // inputs[i][r] of every rank reduced into outputs[i] of rank r; the blocks may differ in
  // size per rank (gloo's uneven form: through blocks padded to the largest).
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    seq_++;
    size_t n = size_t(getSize()), me = size_t(getRank());
    Op o = reduction(opts.reduceOp);
    nonempty("reduce_scatter", outputs.size());
    if (inputs.size() != outputs.size())
      invalid("reduce_scatter: " + std::to_string(inputs.size()) + " input lists for " + std::to_string(outputs.size()) +
              " outputs");
    std::vector<Call> calls;
    std::vector<at::Tensor> extra;
    Post post;
    std::vector<std::pair<at::Tensor, at::Tensor>> blocks;  // (output, padded block)
    for (size_t i = 0; i < outputs.size(); i++) {
      auto& out = outputs[i];
      auto& ins = inputs[i];
      if (ins.size() != n)
        invalid("reduce_scatter: " + std::to_string(ins.size()) + " input tensors for a group of " + std::to_string(n));
      checkTensor(out, "reduce_scatter output");
      int64_t m = 0;
      bool even = true;
      for (auto& t : ins) {
        checkTensor(t, "reduce_scatter input");
        if (t.scalar_type() != out.scalar_type())
          invalid("reduce_scatter: input " + dtypeName(t) + " and output " + dtypeName(out) + " differ");
        m = std::max(m, t.numel());
      }
      for (auto& t : ins) even = even && t.numel() == m;
      if (ins[me].numel() != out.numel())
        invalid("reduce_scatter: this rank's block has " + std::to_string(ins[me].numel()) +
                " elements but the output " + std::to_string(out.numel()));
      at::Tensor flat, target = out;
      if (even) {
        std::vector<at::Tensor> rows;
        for (auto& t : ins) rows.push_back(t.reshape({-1}));
        flat = at::stack(rows);
      } else {
        flat = at::zeros({int64_t(n), m}, out.options().memory_format(at::MemoryFormat::Contiguous));
        for (size_t r = 0; r < n; r++) flat[int64_t(r)].slice(0, 0, ins[r].numel()).copy_(ins[r].reshape({-1}));
        target = at::empty({m}, out.options().memory_format(at::MemoryFormat::Contiguous));
        blocks.emplace_back(out, target);
      }
      scatterFrom(target, flat, o, calls, post, extra);
      extra.push_back(flat);
      extra.push_back(target);
    }
    if (!blocks.empty()) {
      auto prev = std::move(post.then);
      post.then = [blocks, prev] {
        if (prev) prev();
        for (auto& b : blocks) b.first.copy_(b.second.slice(0, 0, b.first.numel()).view(b.first.sizes()));
      };
    }
    return run("reduce_scatter", calls, outputs, OpType::REDUCE_SCATTER, opts.asyncOp, extra, std::move(post));
  }

  // -- all_to_all --------------------------------------------------------------------------
  c10::intrusive_ptr<Work> all_to_all_single(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outSplits,
                                             std::vector<int64_t>& inSplits, const c10d::AllToAllOptions& opts) override {
    return alltoall_base(output, input, outSplits, inSplits, opts);
  }

  // Block p of the input goes to rank p, which stores it as block `rank` of its output; the
  // split sizes (none: equal blocks) give each block's length along dim 0.
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outSplits,
                                         std::vector<int64_t>& inSplits, const c10d::AllToAllOptions& opts) override {
    seq_++;
    int64_t n = getSize();
    if (plain(output) && plain(input) && output.scalar_type() == input.scalar_type() &&
        output.nbytes() == input.nbytes() && equalBlocks(outSplits, output) && equalBlocks(inSplits, input) &&
        !overlap(output, input)) {
      std::vector<Call> calls{{Kind::AllToAll, input.data_ptr(), output.data_ptr(), input.nbytes() / size_t(n),
                               oxcclUint8, oxcclSum, 0}};
      std::vector<at::Tensor> outs{output};
      return run("all_to_all_single", calls, outs, OpType::ALLTOALL_BASE, opts.asyncOp, {input});
    }
    auto outCounts = a2aCounts("output", output, outSplits);
    auto inCounts = a2aCounts("input", input, inSplits);
    Post post;
    Lib s = dense(input, "all_to_all_single input", nullptr, nullptr, true, false);
    Lib r = dense(output, "all_to_all_single output", nullptr, &post, false, false);
    if (input.scalar_type() != output.scalar_type()) invalid("all_to_all_single: input and output dtypes differ");
    std::vector<at::Tensor> outs{output};
    return alltoallv("all_to_all_single", s.t, r.t, outCounts, inCounts, outs, std::move(post), opts.asyncOp,
                     OpType::ALLTOALL_BASE);
  }

  // outputs[r] becomes rank r's inputs[rank].
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    seq_++;
    size_t n = size_t(getSize());
    if (outputs.size() != n || inputs.size() != n)
      invalid("alltoall: expected " + std::to_string(n) + " input and " + std::to_string(n) + " output tensors, got " +
              std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()));
    for (auto& t : inputs) checkTensor(t, "alltoall input");
    for (auto& t : outputs) checkTensor(t, "alltoall output");
    auto dtype = inputs[0].scalar_type();
    for (auto& t : inputs)
      if (t.scalar_type() != dtype) invalid("alltoall: every tensor must have one dtype");
    for (auto& t : outputs)
      if (t.scalar_type() != dtype) invalid("alltoall: every tensor must have one dtype");
    std::vector<at::Tensor> rows;
    std::vector<int64_t> outCounts, inCounts;
    int64_t total = 0;
    for (auto& t : inputs) {
      rows.push_back(t.reshape({-1}));
      inCounts.push_back(t.numel());
    }
    for (auto& t : outputs) {
      outCounts.push_back(t.numel());
      total += t.numel();
    }
    auto send = at::cat(rows);
    auto recv = at::empty({total}, inputs[0].options().memory_format(at::MemoryFormat::Contiguous));
    Post post;
    auto outs = outputs;
    post.then = [outs, recv] {
      int64_t off = 0;
      for (auto& t : outs) {
        t.copy_(recv.slice(0, off, off + t.numel()).view(t.sizes()));
        off += t.numel();
      }
    };
    return alltoallv("all_to_all", send, recv, outCounts, inCounts, outputs, std::move(post), opts.asyncOp,
                     OpType::ALLTOALL);
  }

  // -- gather, scatter ---------------------------------------------------------------------
  // The root's outputs[0][r] becomes rank r's input. The root's arguments are checked on
  // the root only: it tells every rank first (a message of the gather itself), so that a
  // gather refused there fails on every rank before any data moves and the group stays in
  // step.
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) override {
    seq_++;
    int root = int(opts.rootRank), me = getRank(), n = getSize();
    checkRoot("gather", opts.rootRank);
    std::string refusal;
    std::vector<at::Tensor> outs;
    // The root's problems (its input's too) are its refusal, which every rank raises; the
    // others' raise here, before the agreement.
    if (inputs.size() != 1) refusal = "gather: requires exactly one input tensor, got " + std::to_string(inputs.size());
    if (refusal.empty()) refusal = tensorProblem(inputs[0], "gather input");
    if (me != root && !refusal.empty()) invalid(refusal);
    if (me == root) {
      outs = outputs.empty() ? std::vector<at::Tensor>() : outputs[0];
      if (refusal.empty() && outputs.size() > 1)
        refusal = "gather: requires a single output list on the root, got " + std::to_string(outputs.size());
      else if (refusal.empty() && int(outs.size()) != n)
        refusal = "gather: " + std::to_string(outs.size()) + " output tensors on the root for a group of " +
                  std::to_string(n);
      for (size_t i = 0; refusal.empty() && i < outs.size(); i++) {
        refusal = tensorProblem(outs[i], "gather output");
        if (refusal.empty() && (outs[i].numel() != inputs[0].numel() || outs[i].scalar_type() != inputs[0].scalar_type()))
          refusal = "gather: every output tensor must have the input's size and dtype (" +
                    std::to_string(inputs[0].numel()) + " x " + dtypeName(inputs[0]) + ", got " +
                    std::to_string(outs[i].numel()) + " x " + dtypeName(outs[i]) + ")";
      }
    }
    agreeOnRoot("gather", oxcclP2pGather, root, refusal);
    Lib in = dense(inputs[0], "gather input", nullptr, nullptr, true, false);
    auto ops = std::make_shared<std::vector<oxcclP2pOp_t>>();
    Post post;
    std::vector<at::Tensor> extra{in.t};
    if (me != root) {
      ops->push_back(p2pOp(true, root, in.t));
    } else {
      std::vector<at::Tensor> tmps;
      for (auto& o : outs) tmps.push_back(dense(o, "gather output", nullptr, &post, false, false).t);
      at::Tensor mine = in.t;
      for (auto& t : tmps)
        if (overlap(mine, t)) mine = mine.clone();
      for (int p = 0; p < n; p++)
        if (p != me) ops->push_back(p2pOp(false, p, tmps[p]));
      at::Tensor dst = tmps[me];
      post.first = [mine, dst] { dst.copy_(mine.reshape(dst.sizes())); };
      extra.insert(extra.end(), tmps.begin(), tmps.end());
      extra.push_back(mine);
    }
    std::vector<Call> calls{p2pCall(*ops, oxcclP2pGather)};
    return run("gather", calls, outs, OpType::GATHER, opts.asyncOp, extra, std::move(post), ops);
  }

  // Each rank's output becomes the root's inputs[0][rank]; checked as gather.
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    seq_++;
    int root = int(opts.rootRank), me = getRank(), n = getSize();
    checkRoot("scatter", opts.rootRank);
    std::string refusal;
    std::vector<at::Tensor> ins;
    // As gather: the root's problems (its output's too) are its refusal.
    if (outputs.size() != 1)
      refusal = "scatter: requires exactly one output tensor, got " + std::to_string(outputs.size());
    if (refusal.empty()) refusal = tensorProblem(outputs[0], "scatter output");
    if (me != root && !refusal.empty()) invalid(refusal);
    at::Tensor userOut = refusal.empty() ? outputs[0] : at::Tensor();
    if (me == root) {
      ins = inputs.empty() ? std::vector<at::Tensor>() : inputs[0];
      if (refusal.empty() && inputs.size() > 1)
        refusal = "scatter: requires a single input list on the root, got " + std::to_string(inputs.size());
      else if (refusal.empty() && int(ins.size()) != n)
        refusal = "scatter: " + std::to_string(ins.size()) + " input tensors on the root for a group of " +
                  std::to_string(n);
      for (size_t i = 0; refusal.empty() && i < ins.size(); i++) {
        refusal = tensorProblem(ins[i], "scatter input");
        if (refusal.empty() && (ins[i].numel() != userOut.numel() || ins[i].scalar_type() != userOut.scalar_type()))
          refusal = "scatter: every input tensor must have the output's size and dtype (" +
                    std::to_string(userOut.numel()) + " x " + dtypeName(userOut) + ", got " +
                    std::to_string(ins[i].numel()) + " x " + dtypeName(ins[i]) + ")";
      }
    }
    agreeOnRoot("scatter", oxcclP2pScatter, root, refusal);
    Post post;
    Lib out = dense(userOut, "scatter output", nullptr, &post, false, false);
    auto ops = std::make_shared<std::vector<oxcclP2pOp_t>>();
    std::vector<at::Tensor> extra{out.t};
    if (me != root) {
      ops->push_back(p2pOp(false, root, out.t));
    } else {
      std::vector<at::Tensor> srcs;
      for (auto& t : ins) srcs.push_back(dense(t, "scatter input", nullptr, nullptr, true, false).t);
      for (int p = 0; p < n; p++)
        if (p != me) ops->push_back(p2pOp(true, p, srcs[p]));
      at::Tensor mine = srcs[me], dst = out.t;
      if (overlap(mine, dst)) mine = mine.clone();
      post.first = [mine, dst] { dst.copy_(mine.reshape(dst.sizes())); };
      extra.insert(extra.end(), srcs.begin(), srcs.end());
      extra.push_back(mine);
    }
    std::vector<Call> calls{p2pCall(*ops, oxcclP2pScatter)};
    std::vector<at::Tensor> result{userOut};
    return run("scatter", calls, result, OpType::SCATTER, opts.asyncOp, extra, std::move(post), ops);
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    seq_++;
    std::vector<Call> calls{{Kind::Barrier, nullptr, nullptr, 0, oxcclUint8, oxcclSum, 0}};
    std::vector<at::Tensor> none;
    return run("barrier", calls, none, OpType::BARRIER, opts.asyncOp, {}, Post(), nullptr, !opts.asyncOp);
  }

  // gloo's monitored barrier, through the store: rank 0 waits (up to the timeout) for every
  // rank to arrive and names the ones that did not; the others wait for rank 0. The errors
  // carry gloo's phrases too ("Rank 1 failed to pass monitoredBarrier", ...), which code and
  // tests written for gloo look for.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    if (!store_) invalid("monitored_barrier: this group has no store");
    double groupS = timeout_s_ > 0 ? double(timeout_s_) : 1800.0;
    // No timeout given: the group's. A zero or negative one is a timeout too (as gloo's).
    double t = opts.timeout == c10d::kUnsetTimeout ? groupS : opts.timeout.count() / 1000.0;
    int64_t ms = int64_t(t * 1000);
    std::string key = "oxccl/monitored_barrier/" + std::to_string(++barriers_);
    int me = getRank(), n = getSize();
    char secs[32];
    snprintf(secs, sizeof secs, "%g", t);
    if (me != 0) {
      std::string why;
      try {
        store_->set(key + "/" + std::to_string(me), std::vector<uint8_t>{'1'});
        if (t <= 0) {
          if (!store_->check({key + "/done"})) why = std::string("the timeout (") + secs + " s) is not positive";
        } else {
          store_->wait({key + "/done"}, std::chrono::milliseconds(ms));
        }
      } catch (const std::exception& e) {
        why = e.what();
      }
      if (!why.empty())
        raise(oxcclTimeout, "oxccl: rank " + std::to_string(me) + ": monitored_barrier: rank 0 did not release the "
                            "barrier within " + secs + " s (" + why + "); Rank " + std::to_string(me) +
                            " successfully reached monitoredBarrier, but received errors while waiting for "
                            "send/recv from rank 0");
      return;
    }
    if (t <= 0)
      raise(oxcclTimeout, std::string("oxccl: rank 0: monitored_barrier: the timeout (") + secs +
                              " s) is not positive: Rank 0 timed out in monitoredBarrier after " + std::to_string(ms) +
                              " ms");
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    std::vector<int> missing;
    for (int p = 1; p < n; p++) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() < 1) left = std::chrono::milliseconds(1);
      try {
        store_->wait({key + "/" + std::to_string(p)}, left);
      } catch (const std::exception&) {
        missing.push_back(p);
        if (!waitAllRanks) break;
      }
    }
    if (!missing.empty()) {
      std::string list, ranks;
      for (size_t i = 0; i < missing.size(); i++) {
        list += (i ? ", " : "") + std::to_string(missing[i]);
      }
      std::string gloo = missing.size() == 1 ? "Rank " + list + " failed to pass monitoredBarrier"
                                             : "Ranks " + list + " failed to pass monitoredBarrier";
      raise(oxcclTimeout, "oxccl: rank 0: monitored_barrier: rank(s) [" + list + "] did not reach the barrier within " +
                              secs + " s (" + gloo + " in " + std::to_string(ms) + " ms)");
    }
    store_->set(key + "/done", std::vector<uint8_t>{'1'});
  }

  // -- point to point ----------------------------------------------------------------------
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return hold("send", tensors, dst, tag, OpType::SEND);
  }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return hold("recv", tensors, src, tag, OpType::RECV);
  }
  // A recv from whichever rank sends with `tag` first; work._source_rank() (what dist.recv
  // returns) says which.
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return hold("recv", tensors, -1, tag, OpType::RECVANYSOURCE);
  }

  // Runs the held point-to-point operations now (before exit, shutdown).
  void flushHeld() {
    held_->flush();
    dropBatchFrame();
  }

  // -- groups ------------------------------------------------------------------------------
  // A backend for `ranks` (ranks of this group; null for a rank outside them), made by
  // oxccl.torch, which rendezvouses through `store`.
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    if (std::find(ranks.begin(), ranks.end(), getRank()) == ranks.end()) return {};
    py::gil_scoped_acquire gil;
    double t = timeout_s_;
    if (opts && opts->timeout.count() > 0) t = opts->timeout.count() / 1000.0;
    py::object child = state_.attr("split")(store, ranks, opts, t);
    if (child.is_none()) return {};
    return child.cast<c10::intrusive_ptr<Backend>>();
  }

  // destroy_process_group (ProcessGroup.shutdown): held sends and receives go out, queued calls
  // are waited for (each bounded by its timeout), then the communicator is closed (the other
  // ranks see this rank leave); a later call raises oxccl.AbortedError. Idempotent.
  void shutdown() override {
    if (shut_) return;
    shut_ = true;
    std::string err;
    try {
      flushHeld();
    } catch (const std::exception& e) {
      err = e.what();
    }
    py::gil_scoped_acquire gil;
    state_.attr("close")();
  }

  // Every blocked and queued call fails at once (here and, told by the watchdog, on the other
  // ranks), then the communicator is closed.
  void abort() override {
    {
      py::gil_scoped_acquire gil;
      state_.attr("abort")();
    }
    shutdown();
  }

  // The handle of this group for the inference ops (inference.cpp).
  int64_t inferenceHandle() const { return handle_; }

  py::object state() const { return state_; }

 private:
  // -- checks ----------------------------------------------------------------------------
  [[noreturn]] void invalid(const std::string& msg) {
    raise(oxcclInvalidArgument, "oxccl: rank " + std::to_string(getRank()) + ": " + msg);
  }

  void nonempty(const char* what, size_t n) {
    if (n == 0) invalid(std::string(what) + ": requires a non-empty tensor list");
  }

  // What no call can take (not a tensor, not on the CPU, not strided), or "".
  static std::string tensorProblem(const at::Tensor& t, const std::string& what) {
    if (!t.defined()) return what + ": expected a tensor, got None";
    if (!t.device().is_cpu()) return what + ": the tensor is on " + t.device().str() + "; oxccl works on CPU tensors";
    if (t.layout() != at::kStrided) {
      std::ostringstream s;
      s << t.layout();
      return what + ": " + s.str() + " tensors are not supported here";
    }
    return "";
  }

  void checkTensor(const at::Tensor& t, const std::string& what) {
    auto p = tensorProblem(t, what);
    if (!p.empty()) invalid(p);
  }

  // gloo's rule for several tensors in one allreduce or broadcast: one dtype, one shape.
  void sameKind(const char* what, const std::vector<at::Tensor>& ts) {
    for (auto& t : ts) {
      checkTensor(t, what);
      if (t.scalar_type() != ts[0].scalar_type() || t.sizes() != ts[0].sizes())
        invalid(std::string(what) + ": every tensor of the list must have one dtype and shape (" + dtypeName(ts[0]) +
                " " + shapeOf(ts[0]) + " and " + dtypeName(t) + " " + shapeOf(t) + ")");
    }
  }

  // A clear error, before any data moves, for a root outside the group.
  void checkRoot(const char* what, int64_t root) {
    if (root < 0 || root >= getSize())
      invalid(std::string(what) + ": root rank " + std::to_string(root) + " is not in this group of " +
              std::to_string(getSize()) + " (ranks 0 .. " + std::to_string(getSize() - 1) + ")");
  }

  Op simpleOp(const c10d::ReduceOp& r) {
    Op o;
    o.code = opOf(r);
    o.name = opName(o.code);
    return o;
  }

  // The reduction of `r`, or a clear error for one oxccl lacks.
  Op reduction(const c10d::ReduceOp& r) {
    if (opOf(r) >= 0) return simpleOp(r);
    if (r.op_ != c10d::ReduceOp::PREMUL_SUM)
      invalid("the oxccl backend does not support ReduceOp " + std::to_string(int(r.op_)));
    Op o;
    o.premul = true;
    o.name = "PREMUL_SUM";
    auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(r.supplement_.get());
    if (!s) invalid("PREMUL_SUM without a factor");
    o.factor = s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
    if (!std::isfinite(o.factor)) invalid("PREMUL_SUM: the factor " + std::to_string(o.factor) + " is not finite");
    return o;
  }

  // `t` as the library can take it: itself when it is a contiguous tensor of a type the call
  // takes, else a contiguous temporary (a copy of `t` when `read`) that is copied back into
  // `t` after the call when `post` is given. `op` null: the call only moves data (any dtype,
  // as bytes); else a reduction: complex tensors reduce as their real and imaginary parts
  // (SUM, AVG, PREMUL_SUM with a real factor), int16 in int32, and a PREMUL_SUM's `input`
  // is scaled by its factor (in a temporary: the caller's tensor is not written before the
  // call has succeeded).
  Lib dense(const at::Tensor& t, const std::string& what, const Op* op, Post* post, bool read, bool input) {
    checkTensor(t, what);
    at::Tensor tmp = t;
    if (t.is_conj() || t.is_neg()) tmp = t.resolve_conj().resolve_neg();
    if (!tmp.is_contiguous())
      tmp = read ? tmp.contiguous() : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
    Lib lib{tmp, oxcclUint8};
    if (op) {
      lib.dt = dtypeOf(t);
      if (lib.dt < 0) {
        if (t.is_complex()) {
          if (op->code != oxcclSum && op->code != oxcclAvg)
            invalid(what + ": " + op->name + " is not defined on complex tensors (" + dtypeName(t) +
                    "): only SUM, AVG and PREMUL_SUM (a real factor)");
          lib.t = at::view_as_real(tmp);
        } else if (t.scalar_type() == at::kShort) {
          tmp = tmp.to(at::kInt);
          lib.t = tmp;
        } else {
          invalid(what + ": unsupported dtype " + dtypeName(t) + " for a reduction (supported: " + kReducedTypes + ")");
        }
        lib.dt = dtypeOf(lib.t);
      }
      if (op->premul && input) {
        if (tmp.is_same(t)) {
          tmp = t.clone(at::MemoryFormat::Contiguous);
          lib.t = t.is_complex() ? at::view_as_real(tmp) : tmp;
        }
        if (at::isIntegralType(lib.t.scalar_type(), /*includeBool=*/true)) {
          if (op->factor != std::floor(op->factor))
            invalid(what + ": PREMUL_SUM on " + dtypeName(t) + " needs an integer factor, got " +
                    std::to_string(op->factor));
          lib.t.mul_(int64_t(op->factor));
        } else {
          lib.t.mul_(op->factor);
        }
      }
    }
    if (!tmp.is_same(t) && post) post->backs.emplace_back(t, tmp);
    return lib;
  }

  static std::string strides(const at::Tensor& t) {
    std::string s = "(";
    for (int64_t i = 0; i < t.dim(); i++) s += (i ? ", " : "") + std::to_string(t.stride(i));
    return s + (t.dim() == 1 ? ",)" : ")");
  }

  // gloo's allreduce forms: an empty list, sparse tensors, a reduction through a temporary
  // (complex, int16, PREMUL_SUM, non-contiguous), several tensors of one rank reduced
  // together (locally too), each getting the result.
  c10::intrusive_ptr<Work> allreduceForms(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
    nonempty("allreduce", tensors.size());
    for (auto& t : tensors)
      if (t.defined() && t.layout() == at::kSparse) return sparseAllreduce(tensors, opts);
    Op o = reduction(opts.reduceOp);
    Post post;
    if (tensors.size() == 1) {
      Lib l = dense(tensors[0], "all_reduce output", &o, &post, true, true);
      std::vector<Call> calls{reduceCall(Kind::AllReduce, l, o, 0)};
      return run("all_reduce", calls, tensors, OpType::ALLREDUCE, opts.asyncOp, {l.t}, std::move(post));
    }
    sameKind("allreduce", tensors);
    if (o.premul || o.code == oxcclAvg)
      invalid(std::string("allreduce: ") + o.name + " of several tensors in one call is not supported (gloo: neither)");
    if (tensors[0].is_complex() && o.code != oxcclSum)
      invalid(std::string("allreduce: ") + o.name + " is not defined on complex tensors (" + dtypeName(tensors[0]) + ")");
    at::Tensor acc = tensors[0].resolve_conj().resolve_neg().clone(at::MemoryFormat::Contiguous);
    for (size_t i = 1; i < tensors.size(); i++) acc = combine(o.code, acc, tensors[i]);
    Lib l = dense(acc, "all_reduce output", &o, &post, true, true);
    auto all = tensors;
    post.then = [all, acc] {
      for (auto& t : all) t.copy_(acc);
    };
    std::vector<Call> calls{reduceCall(Kind::AllReduce, l, o, 0)};
    return run("all_reduce", calls, tensors, OpType::ALLREDUCE, opts.asyncOp, {l.t, acc}, std::move(post));
  }

  static at::Tensor combine(int code, const at::Tensor& a, const at::Tensor& b) {
    switch (code) {
      case oxcclProd: return at::mul(a, b);
      case oxcclMax: return at::maximum(a, b);
      case oxcclMin: return at::minimum(a, b);
      case oxcclBand: return at::bitwise_and(a, b);
      case oxcclBor: return at::bitwise_or(a, b);
      case oxcclBxor: return at::bitwise_xor(a, b);
      default: return at::add(a, b);
    }
  }

  // gloo's sparse all_reduce: every rank's (coalesced) indices and values gathered, summed by
  // coalescing; the result written into each tensor. SUM only. Several sparse tensors of one
  // shape and dtype (gloo's form) are summed locally first, and every one gets the result.
  // Blocking (the sizes are exchanged first).
  c10::intrusive_ptr<Work> sparseAllreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
    const at::Tensor& first = tensors[0];
    for (auto& t : tensors) {
      if (!t.defined() || t.layout() != at::kSparse)
        invalid("allreduce: sparse and dense tensors cannot be mixed in one call");
      if (!t.device().is_cpu()) invalid("allreduce: the tensor is on " + t.device().str() + "; oxccl works on CPU tensors");
      if (t.sizes() != first.sizes() || t.scalar_type() != first.scalar_type())
        invalid("allreduce: every sparse tensor of the list must have one dtype and shape (" + dtypeName(first) + " " +
                shapeOf(first) + " and " + dtypeName(t) + " " + shapeOf(t) + ")");
    }
    Op o = reduction(opts.reduceOp);
    if (o.premul || o.code != oxcclSum) invalid(std::string("allreduce: sparse tensors support only SUM, not ") + o.name);
    int64_t n = getSize();
    at::Tensor s = first.coalesce();
    for (size_t i = 1; i < tensors.size(); i++) s = (s + tensors[i]).coalesce();
    auto idx = s.indices().contiguous(), val = s.values().contiguous();
    int64_t nnz = idx.size(1);
    auto counts = at::empty({n}, at::kLong);
    auto mine = at::full({1}, nnz, at::kLong);
    flushBeforeCollective();
    check(api_->all_gather(mine.data_ptr(), counts.data_ptr(), 8, oxcclUint8, comm_));
    int64_t m = counts.max().item<int64_t>();
    if (m > 0) {
      auto pi = at::zeros({idx.size(0), m}, idx.options());
      pi.slice(1, 0, nnz).copy_(idx);
      auto vshape = val.sizes().vec();
      vshape[0] = m;
      auto pv = at::zeros(vshape, val.options());
      pv.slice(0, 0, nnz).copy_(val);
      auto gshape = [n](const at::Tensor& t) {
        std::vector<int64_t> v{n};
        for (auto d : t.sizes()) v.push_back(d);
        return v;
      };
      auto gi = at::empty(gshape(pi), pi.options());
      auto gv = at::empty(gshape(pv), pv.options());
      check(api_->all_gather(pi.data_ptr(), gi.data_ptr(), pi.nbytes(), oxcclUint8, comm_));
      if (pv.nbytes()) check(api_->all_gather(pv.data_ptr(), gv.data_ptr(), pv.nbytes(), oxcclUint8, comm_));
      std::vector<at::Tensor> is, vs;
      auto c = counts.accessor<int64_t, 1>();
      for (int64_t r = 0; r < n; r++) {
        is.push_back(gi[r].slice(1, 0, c[r]));
        vs.push_back(gv[r].slice(0, 0, c[r]));
      }
      auto total = at::sparse_coo_tensor(at::cat(is, 1), at::cat(vs), first.sizes()).coalesce();
      for (auto& t : tensors) t.copy_(total);
    }
    return c10::make_intrusive<DoneWork>(Value(tensors), OpType::ALLREDUCE);
  }

  static Call reduceCall(Kind kind, const Lib& l, const Op& o, int root) {
    return {kind, l.t.data_ptr(), l.t.data_ptr(), size_t(l.t.numel()), l.dt, o.code, root};
  }

  // all_gather_into_tensor: separate, or in place as NCCL's (the input is this rank's block);
  // other overlaps through a copy of the input, other layouts through temporaries.
  void gatherInto(at::Tensor& output, at::Tensor& input, std::vector<Call>& calls, Post& post,
                  std::vector<at::Tensor>& extra) {
    size_t n = size_t(getSize());
    checkTensor(input, "all_gather input");
    checkTensor(output, "all_gather output");
    if (input.scalar_type() != output.scalar_type())
      invalid("all_gather: input is " + dtypeName(input) + " but output is " + dtypeName(output));
    if (output.numel() != input.numel() * int64_t(n))
      invalid("all_gather: the output has " + std::to_string(output.numel()) + " elements, expected " +
              std::to_string(n) + " x the input's " + std::to_string(input.numel()));
    Lib out = dense(output, "all_gather output", nullptr, &post, false, false);
    Lib in = dense(input, "all_gather input", nullptr, nullptr, true, false);
    auto* mine = static_cast<char*>(out.t.data_ptr()) + in.t.nbytes() * size_t(getRank());
    if (overlap(out.t, in.t) && !(mine == in.t.data_ptr() && out.t.is_same(output))) in.t = in.t.clone();
    calls.push_back({Kind::AllGather, in.t.data_ptr(), out.t.data_ptr(), in.t.nbytes(), oxcclUint8, oxcclSum, 0});
    extra.push_back(in.t);
    extra.push_back(out.t);
  }

  // reduce_scatter_tensor: separate, or in place as NCCL's (the output is this rank's block).
  void scatterFrom(const at::Tensor& output, const at::Tensor& input, const Op& o, std::vector<Call>& calls, Post& post,
                   std::vector<at::Tensor>& extra) {
    size_t n = size_t(getSize());
    checkTensor(input, "reduce_scatter input");
    checkTensor(output, "reduce_scatter output");
    if (input.scalar_type() != output.scalar_type())
      invalid("reduce_scatter: input is " + dtypeName(input) + " but output is " + dtypeName(output));
    if (input.numel() != output.numel() * int64_t(n))
      invalid("reduce_scatter: the input has " + std::to_string(input.numel()) + " elements, expected " +
              std::to_string(n) + " x the output's " + std::to_string(output.numel()));
    Lib out = dense(output, "reduce_scatter output", &o, &post, false, false);
    Lib in = dense(input, "reduce_scatter input", &o, nullptr, true, true);
    auto* mine = static_cast<char*>(in.t.data_ptr()) + out.t.nbytes() * size_t(getRank());
    if (overlap(out.t, in.t) && mine != out.t.data_ptr()) in.t = in.t.clone();
    calls.push_back({Kind::ReduceScatter, in.t.data_ptr(), out.t.data_ptr(), size_t(out.t.numel()), out.dt, o.code, 0});
    extra.push_back(in.t);
    extra.push_back(out.t);
  }

  // inputs[i] of every rank into outputs[i] (one tensor per rank), each through a flat buffer.
  c10::intrusive_ptr<Work> gatherEach(const char* what, std::vector<std::vector<at::Tensor>>& outputs,
                                      std::vector<at::Tensor>& inputs, bool async, OpType type) {
    size_t n = size_t(getSize());
    std::vector<Call> calls;
    std::vector<at::Tensor> extra, result;
    std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> posts;
    for (size_t i = 0; i < inputs.size(); i++) {
      auto& outs = outputs[i];
      auto& in = inputs[i];
      if (outs.size() != n)
        invalid(std::string(what) + ": " + std::to_string(outs.size()) + " output tensors for a group of " +
                std::to_string(n));
      checkTensor(in, std::string(what) + " input");
      for (auto& o : outs) {
        checkTensor(o, std::string(what) + " output");
        if (o.numel() != in.numel() || o.scalar_type() != in.scalar_type())
          invalid(std::string(what) + ": every output tensor must have the input's size and dtype (" +
                  std::to_string(in.numel()) + " x " + dtypeName(in) + ", got " + std::to_string(o.numel()) + " x " +
                  dtypeName(o) + ")");
      }
      Lib l = dense(in, std::string(what) + " input", nullptr, nullptr, true, false);
      auto flat = at::empty({int64_t(n), in.numel()}, in.options().memory_format(at::MemoryFormat::Contiguous));
      calls.push_back({Kind::AllGather, l.t.data_ptr(), flat.data_ptr(), l.t.nbytes(), oxcclUint8, oxcclSum, 0});
      posts.emplace_back(flat, outs);
      extra.push_back(l.t);
      extra.push_back(flat);
      result.insert(result.end(), outs.begin(), outs.end());
    }
    Post post;
    post.then = [posts] {
      for (auto& p : posts)
        for (size_t r = 0; r < p.second.size(); r++) p.second[r].copy_(p.first[int64_t(r)].view(p.second[r].sizes()));
    };
    return run(what, calls, result, type, async, extra, std::move(post));
  }

  bool equalBlocks(const std::vector<int64_t>& s, const at::Tensor& t) {
    int64_t n = getSize();
    if (t.dim() == 0 || t.size(0) % n != 0) return false;
    if (s.empty()) return true;
    if (int64_t(s.size()) != n) return false;
    for (auto v : s)
      if (v != s[0]) return false;
    return s[0] * n == t.size(0);
  }

  // Elements per peer of all_to_all_single's `t`, split along dim 0 by `splits` (none: equal
  // blocks); torch's rules (gloo's and NCCL's checkSplitSizes).
  std::vector<int64_t> a2aCounts(const std::string& what, const at::Tensor& t, const std::vector<int64_t>& splits) {
    int64_t n = getSize();
    checkTensor(t, "all_to_all_single " + what);
    if (t.dim() == 0) invalid("all_to_all_single: the " + what + " is a 0-dim tensor: it has no dim 0 to split");
    int64_t rows = t.size(0), row = 1;
    for (int64_t d = 1; d < t.dim(); d++) row *= t.size(d);
    if (splits.empty()) {
      if (rows % n)
        invalid("all_to_all_single: the " + what + "'s dim 0 (" + std::to_string(rows) +
                ") does not divide equally across group size " + std::to_string(n));
      return std::vector<int64_t>(size_t(n), rows / n * row);
    }
    if (int64_t(splits.size()) != n)
      invalid("all_to_all_single: " + std::to_string(splits.size()) + " " + what + " split sizes for a group of " +
              std::to_string(n));
    int64_t sum = 0;
    bool neg = false;
    std::string list = "[";
    for (size_t i = 0; i < splits.size(); i++) {
      sum += splits[i];
      neg = neg || splits[i] < 0;
      list += (i ? ", " : "") + std::to_string(splits[i]);
    }
    list += "]";
    if (neg || sum != rows)
      invalid("all_to_all_single: " + what + " split sizes " + list + " are not " + std::to_string(n) +
              " non-negative sizes adding up to its dim 0 (" + std::to_string(rows) + ")");
    std::vector<int64_t> out;
    for (auto s : splits) out.push_back(s * row);
    return out;
  }

  // All-to-all with per-peer element counts: one all_to_all when the blocks are equal, else
  // the library's all_to_allv (a send and a receive per peer), this rank's own block copied
  // once it has finished.
  c10::intrusive_ptr<Work> alltoallv(const char* what, at::Tensor send, at::Tensor recv,
                                     const std::vector<int64_t>& outCounts, const std::vector<int64_t>& inCounts,
                                     std::vector<at::Tensor>& result, Post post, bool async, OpType type) {
    int n = getSize(), me = getRank();
    bool equal = outCounts == inCounts;
    for (auto c : outCounts) equal = equal && c == outCounts[0];
    if (equal) {
      if (overlap(send, recv) && !send.is_same(recv)) send = send.clone();
      std::vector<Call> calls{{Kind::AllToAll, send.data_ptr(), recv.data_ptr(), send.nbytes() / size_t(n), oxcclUint8,
                               oxcclSum, 0}};
      return run(what, calls, result, type, async, {send, recv}, std::move(post));
    }
    if (overlap(send, recv)) send = send.clone();  // the sends read a copy (receives land meanwhile)
    auto s = send.reshape({-1}), r = recv.reshape({-1});
    auto ops = std::make_shared<std::vector<oxcclP2pOp_t>>();
    int64_t so = 0, ro = 0;
    at::Tensor mineS, mineR;
    for (int p = 0; p < n; p++) {
      auto sb = s.slice(0, so, so + inCounts[p]);
      auto rb = r.slice(0, ro, ro + outCounts[p]);
      so += inCounts[p];
      ro += outCounts[p];
      if (p == me) {
        mineS = sb;
        mineR = rb;
      } else {
        ops->push_back(p2pOp(true, p, sb));
        ops->push_back(p2pOp(false, p, rb));
      }
    }
    if (mineS.numel() != mineR.numel())
      invalid(std::string(what) + ": this rank sends itself " + std::to_string(mineS.numel()) +
              " elements but receives " + std::to_string(mineR.numel()));
    post.first = [mineS, mineR] { mineR.copy_(mineS); };
    std::vector<Call> calls{p2pCall(*ops, oxcclP2pAllToAllv)};
    return run(what, calls, result, type, async, {send, recv}, std::move(post), ops);
  }

  static oxcclP2pOp_t p2pOp(bool send, int peer, const at::Tensor& t) {
    oxcclP2pOp_t op{};
    op.send = send ? 1 : 0;
    op.peer = peer;
    op.tag = 0;
    op.datatype = oxcclUint8;
    op.buff = t.nbytes() ? t.data_ptr() : nullptr;
    op.count = t.nbytes();
    op.source = -1;
    return op;
  }

  static Call p2pCall(std::vector<oxcclP2pOp_t>& ops, int call) {
    Call c{Kind::P2p, nullptr, nullptr, 0, oxcclUint8, oxcclSum, 0};
    c.ops = &ops;
    c.p2p = call;
    return c;
  }

  // Before a gather or scatter moves any data: the root tells every rank whether it takes the
  // call (a message of that call itself, so a gather on one rank against a scatter on another
  // is still the library's mismatch naming both), and every rank raises the root's refusal:
  // the root its own error, the others one naming the root's.
  void agreeOnRoot(const char* what, int call, int root, const std::string& refusal) {
    constexpr size_t kMsg = 256;
    int me = getRank(), n = getSize();
    std::vector<oxcclP2pOp_t> ops;
    std::vector<std::vector<char>> bufs;
    if (me == root) {
      std::vector<char> msg(kMsg, 0);
      if (!refusal.empty()) {
        msg[0] = 1;
        std::memcpy(msg.data() + 1, refusal.data(), std::min(refusal.size(), kMsg - 2));
      }
      bufs.push_back(msg);
      for (int p = 0; p < n; p++)
        if (p != me) ops.push_back({1, p, 0, oxcclUint8, bufs[0].data(), kMsg, -1});
    } else {
      bufs.emplace_back(kMsg, 0);
      ops.push_back({0, root, 0, oxcclUint8, bufs[0].data(), kMsg, -1});
    }
    flushBeforeCollective();
    check(api_->p2p(ops.data(), ops.size(), oxcclP2pCall_t(call), comm_));
    if (me == root) {
      if (!refusal.empty()) invalid(refusal);
      return;
    }
    if (bufs[0][0]) {
      std::string theirs(bufs[0].data() + 1, strnlen(bufs[0].data() + 1, kMsg - 2));
      invalid(std::string(what) + ": the root (rank " + std::to_string(root) + ") refused the call, before any data "
              "moved: " + theirs);
    }
  }

  // Holds a send or recv (`peer` -1: from any rank) until a wait, a future, the next
  // collective or shutdown runs every held one as one group.
  c10::intrusive_ptr<Work> hold(const char* kind, std::vector<at::Tensor>& tensors, int peer, int tag, OpType type) {
    py::object frame = batchFrame();
    size_t serial = 0;
    if (frame) {
      py::gil_scoped_acquire gil;
      if (!batch_ || !batch_.is(frame)) {
        batch_ = frame;
        batches_++;
      }
      serial = batches_;
      frame = py::object();
    }
    bool isSend = std::string(kind) == "send";
    // A refused operation of a batch drops the batch's operations held before it.
    auto refuse = [&](const std::string& m) {
      std::string full = "oxccl: rank " + std::to_string(getRank()) + ": " + m;
      if (serial) held_->dropBatch(serial, full);
      raise(oxcclInvalidArgument, full);
    };
    if (tag < 0) refuse(std::string(kind) + ": tag " + std::to_string(tag) + " is outside 0 .. 2**32-1");
    if (peer != -1 && (peer < 0 || peer >= getSize()))
      refuse(std::string(kind) + ": rank " + std::to_string(peer) + " is not in this group of " +
             std::to_string(getSize()));
    auto job = std::make_shared<HeldJob>();
    job->what = std::string(kind) + (isSend ? " to " : " from ") +
                (peer < 0 ? std::string("any rank") : "rank " + std::to_string(peer)) + " (tag " +
                std::to_string(tag) + ")";
    std::vector<oxcclP2pOp_t> ops;
    for (auto& t : tensors) {
      auto p = tensorProblem(t, std::string(kind) + " buffer");
      if (!p.empty()) refuse(p);
      if (!t.is_contiguous())
        refuse(std::string(kind) + " buffer: the tensor is not contiguous (strides " + strides(t) +
               "); pass x.contiguous()");
      if (t.is_complex() && (t.is_conj() || t.is_neg()))
        refuse(std::string(kind) + " buffer: lazily conjugated/negated tensors are not supported");
      oxcclP2pOp_t op = p2pOp(isSend, peer, t);
      op.tag = uint32_t(tag);
      ops.push_back(op);
    }
    job->tensors = tensors;
    if (!ops.empty()) held_->hold(job, ops, serial);
    else {
      job->held = false;
      job->failed = true;
      job->code = oxcclInvalidArgument;
      job->msg = "oxccl: " + job->what + ": no tensor";
    }
    return c10::make_intrusive<HeldWork>(held_, job, type, getRank());
  }

  // The held operations go before a collective, and the batch_isend_irecv they came from is
  // over.
  void flushBeforeCollective() {
    held_->flush();
    dropBatchFrame();
  }

  void dropBatchFrame() {
    if (batches_ == lastDropped_) return;
    lastDropped_ = batches_;
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    batch_ = py::object();
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
      case Kind::P2p:
        return api_->p2p(c.ops->data(), c.ops->size(), oxcclP2pCall_t(c.p2p), comm_);
    }
    return oxcclInternalError;
  }

  void check(oxcclResult_t r) {
    if (r != oxcclSuccess) raise(r, api_->get_last_error());
  }

  // Runs `calls` in order: inline when small and not asynchronous (`async`: torch's
  // opts.asyncOp, set by async_op=True and by torch's own callers such as DDP and functional
  // collectives) or `inlineAlways`, else queued as one group, so that an asynchronous call
  // returns before the peers arrive (as gloo's). `extra`: tensors the queued calls use
  // besides the result (inputs, temporaries), `hold` other memory (point-to-point
  // operations), kept until they finish; `post` runs once they have succeeded.
  c10::intrusive_ptr<Work> run(const char* what, std::vector<Call>& calls, Value value, OpType type, bool async,
                               std::vector<at::Tensor> extra = {}, Post post = Post(),
                               std::shared_ptr<void> hold = nullptr, bool inlineAlways = false) {
    flushBeforeCollective();
    size_t bytes = 0;
    for (auto& t : value.flat) bytes += t.defined() ? t.nbytes() : 0;
    for (auto& t : extra) bytes = std::max(bytes, t.defined() ? t.nbytes() : size_t(0));
    if (inlineAlways || (!async && bytes <= kInlineMaxBytes)) {
      for (auto& c : calls) check(issue(c));
      post.run();
      return c10::make_intrusive<DoneWork>(std::move(value), type);
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
    std::vector<at::Tensor> keep = value.flat;
    keep.insert(keep.end(), extra.begin(), extra.end());
    return c10::make_intrusive<QueuedWork>(api_, w, std::move(value), std::move(keep), std::move(post),
                                           std::move(hold), type, timeout_s_, getRank(), what);
  }

  py::object state_;  // oxccl.torch's record of the group: close, abort, split
  c10::intrusive_ptr<c10d::Store> store_;
  const oxcclApi_t* api_;
  oxcclComm_t comm_;
  std::atomic<double> timeout_s_;
  uint64_t seq_ = 0;  // collectives called (getSequenceNumberForGroup)
  uint64_t barriers_ = 0;
  bool shut_ = false;
  std::shared_ptr<Group> group_;
  std::shared_ptr<Held> held_;
  py::object batch_;  // the batch_isend_irecv frame of the operations held last
  size_t batches_ = 0, lastDropped_ = 0;
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
  m.doc() = "oxccl's torch backend (see oxccl/csrc/backend.cpp)";
  py::class_<BackendOxcclCpp, c10d::Backend, c10::intrusive_ptr<BackendOxcclCpp>>(m, "BackendOxcclCpp")
      .def(py::init([](uintptr_t comm, py::capsule api, int rank, int size, double timeout_s,
                       c10::intrusive_ptr<c10d::Store> store, py::object state) {
             TORCH_CHECK(std::string(api.name()) == "oxccl._C_API", "oxccl: not the oxccl._C_API capsule");
             auto* table = static_cast<const oxcclApi_t*>(api.get_pointer());
             TORCH_CHECK(table->version >= OXCCL_API_VERSION && table->size >= sizeof(oxcclApi_t),
                         "oxccl: the C++ torch backend was built for another oxccl (API version ",
                         OXCCL_API_VERSION, ", library ", table->version, "): rebuild it");
             if (!oxccl_torch::g_api) oxccl_torch::g_api = table;
             return c10::make_intrusive<BackendOxcclCpp>(comm, table, rank, size, timeout_s, std::move(store),
                                                         std::move(state));
           }),
           py::arg("comm"), py::arg("api"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
           py::arg("store"), py::arg("state"),
           "The backend of rank `rank` of `size` on the communicator's C handle `comm` (which it "
           "owns); `timeout_s` the group's timeout (not positive: the communicator's); `store` the "
           "group's store (monitored_barrier); `state` oxccl.torch's record of the group, whose "
           "close(), abort() and split(store, ranks, opts, timeout_s) it calls.")
      .def_property_readonly("inference_handle", &BackendOxcclCpp::inferenceHandle,
                             "This group's handle for the inference ops (torch.ops.oxccl.*).")
      .def_property_readonly("_state", &BackendOxcclCpp::state,
                             "oxccl.torch's record of the group (its communicator, its store).")
      .def("_flush_held", &BackendOxcclCpp::flushHeld, py::call_guard<py::gil_scoped_release>(),
           "Runs the held sends and receives now.");
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
      "flush_held",
      []() {
        std::vector<std::shared_ptr<oxccl_torch::Held>> live;
        {
          std::lock_guard<std::mutex> lock(oxccl_torch::g_helds_m);
          for (auto& w : oxccl_torch::g_helds)
            if (auto h = w.lock()) live.push_back(h);
        }
        py::gil_scoped_release nogil;
        for (auto& h : live) h->flush();
      },
      "Runs the held sends and receives of every live group (at exit: a rank that never waited "
      "on an isend still sends it).");
  m.def(
      "wait_now",
      [](const c10::intrusive_ptr<c10d::Work>& w) -> py::object {
        if (auto* q = dynamic_cast<oxccl_torch::QueuedWork*>(w.get())) return py::bool_(q->waitNow());
        if (dynamic_cast<oxccl_torch::DoneWork*>(w.get())) return py::bool_(true);
        if (auto* h = dynamic_cast<oxccl_torch::HeldWork*>(w.get())) return py::bool_(h->waitNow());
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
        TORCH_CHECK(table->version >= OXCCL_API_VERSION, "oxccl: the C++ torch backend was built for another oxccl: rebuild it");
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
  m.attr("INLINE_MAX_BYTES") = oxccl_torch::kInlineMaxBytes;
}
