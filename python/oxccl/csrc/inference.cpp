// The inference ops: all_reduce and all_gather for tensor-parallel inference, as torch
// operators (TORCH_LIBRARY "oxccl") that torch.compile traces, and as direct functions for
// eager calls (no dispatcher, no c10d Work: the library's C ABI on the calling thread).
//
//   torch.ops.oxccl.inference_all_reduce_(Tensor(a!) self, int group, int op=0) -> ()
//   torch.ops.oxccl.inference_all_reduce(Tensor self, int group, int op=0) -> Tensor
//   torch.ops.oxccl.inference_all_gather(Tensor self, int group) -> Tensor
//
// `group` is the handle of an oxccl group (groups.h; oxccl.torch finds it from a
// ProcessGroup), `op` oxccl's oxcclRedOp_t (0 SUM, 1 PRODUCT, 2 MAX, 3 MIN, 4 AVG, 5 BAND,
// 6 BOR, 7 BXOR). The mutating op returns nothing, so torch's automatic functionalization
// (auto_functionalized) handles it under torch.compile; the Meta kernels give shapes to
// fake tensors. all_gather concatenates the ranks' tensors along dim 0 (a 0-d tensor counts
// as one element). Every call is bounded by the group's timeout (the library's), and
// raises oxccl's exception classes (oxccl._errors).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <pybind11/pybind11.h>

#include <mutex>
#include <string>
#include <vector>

#include "groups.h"

namespace py = pybind11;

namespace oxccl_torch {

int dtypeOf(const at::Tensor& t);  // backend.cpp

namespace {

std::mutex g_groups_m;

// Index: handle; 0 is never one. Never destroyed: a group still registered at exit (its
// backend leaked) keeps its communicator rather than tearing it down in a static destructor.
std::vector<std::shared_ptr<Group>>& groups() {
  static auto* v = new std::vector<std::shared_ptr<Group>>(1);
  return *v;
}

}  // namespace

int64_t registerGroup(std::shared_ptr<Group> g) {
  std::lock_guard<std::mutex> lock(g_groups_m);
  groups().push_back(std::move(g));
  return int64_t(groups().size() - 1);
}

void unregisterGroup(int64_t handle) {
  std::shared_ptr<Group> gone;  // let go of outside the lock (it may destroy the communicator)
  {
    std::lock_guard<std::mutex> lock(g_groups_m);
    if (handle > 0 && size_t(handle) < groups().size()) gone.swap(groups()[size_t(handle)]);
  }
}

std::shared_ptr<Group> findGroup(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_groups_m);
  if (handle > 0 && size_t(handle) < groups().size()) return groups()[size_t(handle)];
  return nullptr;
}

namespace {

std::shared_ptr<Group> need(int64_t handle, const char* what) {
  auto g = findGroup(handle);
  if (!g)
    raise(oxcclInvalidArgument, std::string("oxccl: ") + what + ": group handle " + std::to_string(handle) +
                                    " is not a live oxccl group of this process (its group was destroyed, or "
                                    "the handle was not made by oxccl.torch)");
  return g;
}

std::string prefix(const Group& g, const char* what) {
  return "oxccl: rank " + std::to_string(g.rank) + ": " + what + ": ";
}

void checkDense(const Group& g, const at::Tensor& t, const char* what) {
  if (!t.defined() || t.layout() != at::kStrided || !(t.device().is_cpu() || t.device().is_meta()))
    raise(oxcclInvalidArgument, prefix(g, what) + "a dense CPU tensor is required" +
                                    (t.defined() ? std::string(" (got one on ") + t.device().str() + ")" : ""));
}

// The library's dtype and op for a reduction of `t`, or an InvalidArgumentError.
std::pair<oxcclDataType_t, oxcclRedOp_t> reduction(const Group& g, const at::Tensor& t, int64_t op,
                                                   const char* what) {
  checkDense(g, t, what);
  int dt = dtypeOf(t);
  if (dt < 0)
    raise(oxcclInvalidArgument, prefix(g, what) + "dtype " + std::string(c10::toString(t.scalar_type())) +
                                    " cannot be reduced (oxccl reduces float32, float64, float16, bfloat16, "
                                    "int8, uint8, uint16, int32, uint32, int64, uint64 and bool)");
  if (op < oxcclSum || op > oxcclBxor)
    raise(oxcclInvalidArgument, prefix(g, what) + "op " + std::to_string(op) +
                                    " is not one of oxccl's (0 SUM .. 7 BXOR; PREMUL_SUM is not supported here)");
  return {oxcclDataType_t(dt), oxcclRedOp_t(op)};
}

void check(const Group& g, oxcclResult_t r) {
  if (r != oxcclSuccess) raise(r, g.api->get_last_error());
}

// All-reduces `t` in place on `g` (through a contiguous temporary when it is not one).
void allReduceInPlace(const Group& g, const at::Tensor& t, int64_t op) {
  auto [dt, rop] = reduction(g, t, op, "inference_all_reduce");
  if (t.is_contiguous() && !t.is_neg()) {
    void* p = t.data_ptr();
    check(g, g.api->all_reduce(p, p, size_t(t.numel()), dt, rop, g.comm));
    return;
  }
  at::Tensor c = t.resolve_neg().contiguous();  // a copy: t is not contiguous, or negated
  void* p = c.data_ptr();
  check(g, g.api->all_reduce(p, p, size_t(c.numel()), dt, rop, g.comm));
  t.copy_(c);
}

std::vector<int64_t> gatheredShape(const Group& g, const at::Tensor& t) {
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  if (shape.empty()) shape.push_back(1);
  shape[0] *= g.size;
  return shape;
}

at::Tensor allGather(const Group& g, const at::Tensor& t) {
  checkDense(g, t, "inference_all_gather");
  at::Tensor in = t.resolve_conj().resolve_neg().contiguous();
  at::Tensor out = at::empty(gatheredShape(g, t), in.options().memory_format(at::MemoryFormat::Contiguous));
  check(g, g.api->all_gather(in.data_ptr(), out.data_ptr(), in.nbytes(), oxcclUint8, g.comm));
  return out;
}

// -- operator kernels ------------------------------------------------------------------------
void allReduceCpu(const at::Tensor& self, int64_t group, int64_t op) {
  auto g = need(group, "inference_all_reduce_");
  allReduceInPlace(*g, self, op);
}

at::Tensor allReduceFunctionalCpu(const at::Tensor& self, int64_t group, int64_t op) {
  auto g = need(group, "inference_all_reduce");
  reduction(*g, self, op, "inference_all_reduce");
  at::Tensor out = at::empty_like(self, at::MemoryFormat::Contiguous);
  out.copy_(self);
  allReduceInPlace(*g, out, op);
  return out;
}

at::Tensor allGatherCpu(const at::Tensor& self, int64_t group) {
  auto g = need(group, "inference_all_gather");
  return allGather(*g, self);
}

void allReduceMeta(const at::Tensor& self, int64_t group, int64_t op) {
  auto g = need(group, "inference_all_reduce_");
  reduction(*g, self, op, "inference_all_reduce_");
}

at::Tensor allReduceFunctionalMeta(const at::Tensor& self, int64_t group, int64_t op) {
  auto g = need(group, "inference_all_reduce");
  reduction(*g, self, op, "inference_all_reduce");
  return at::empty_like(self, at::MemoryFormat::Contiguous);
}

at::Tensor allGatherMeta(const at::Tensor& self, int64_t group) {
  auto g = need(group, "inference_all_gather");
  checkDense(*g, self, "inference_all_gather");
  return at::empty(gatheredShape(*g, self), self.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

// -- direct calls (eager; oxccl.torch's inference_all_reduce and inference_all_gather) ----
// inference_all_reduce_(tensor, group, op): a plain CPython function (METH_FASTCALL, no
// pybind11 dispatch: a third of the call's cost on one rank).
PyObject* allReduceDirect(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !THPVariable_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "inference_all_reduce_(tensor, group: int, op: int)");
    return nullptr;
  }
  int64_t group = PyLong_AsLongLong(args[1]);
  int64_t op = PyLong_AsLongLong(args[2]);
  if (PyErr_Occurred()) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(args[0]);
  try {
    if (t.requires_grad()) {  // autograd's rules: through the dispatcher
      static auto handle = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("oxccl::inference_all_reduce_", "")
                               .typed<void(const at::Tensor&, int64_t, int64_t)>();
      py::gil_scoped_release nogil;
      handle.call(t, group, op);
      Py_RETURN_NONE;
    }
    auto g = need(group, "inference_all_reduce");
    {
      py::gil_scoped_release nogil;
      allReduceInPlace(*g, t, op);
    }
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  } catch (py::error_already_set& e) {  // an oxccl error (raise())
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef g_all_reduce_def = {
    "inference_all_reduce_", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&allReduceDirect)),
    METH_FASTCALL,
    "inference_all_reduce_(tensor, group, op): all-reduces `tensor` in place on the group of handle "
    "`group` (eager; the operator torch.ops.oxccl.inference_all_reduce_ without the dispatcher)."};

void defineInferenceFunctions(py::module_& m) {
  m.add_object("inference_all_reduce_", py::reinterpret_steal<py::object>(PyCFunction_New(&g_all_reduce_def, nullptr)));
  m.def(
      "inference_all_gather",
      [](const at::Tensor& t, int64_t group) {
        auto g = need(group, "inference_all_gather");
        py::gil_scoped_release nogil;
        return allGather(*g, t);
      },
      py::arg("tensor"), py::arg("group"),
      "The group's tensors concatenated along dim 0 (eager; torch.ops.oxccl.inference_all_gather).");
}

}  // namespace oxccl_torch

TORCH_LIBRARY(oxccl, m) {
  m.def("inference_all_reduce_(Tensor(a!) self, int group, int op=0) -> ()");
  m.def("inference_all_reduce(Tensor self, int group, int op=0) -> Tensor");
  m.def("inference_all_gather(Tensor self, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(oxccl, CPU, m) {
  m.impl("inference_all_reduce_", &oxccl_torch::allReduceCpu);
  m.impl("inference_all_reduce", &oxccl_torch::allReduceFunctionalCpu);
  m.impl("inference_all_gather", &oxccl_torch::allGatherCpu);
}

TORCH_LIBRARY_IMPL(oxccl, Meta, m) {
  m.impl("inference_all_reduce_", &oxccl_torch::allReduceMeta);
  m.impl("inference_all_reduce", &oxccl_torch::allReduceFunctionalMeta);
  m.impl("inference_all_gather", &oxccl_torch::allGatherMeta);
}
