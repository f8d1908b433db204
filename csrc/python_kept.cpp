// dpfast._C._kept_cut: the kept-call path of DistributedDataParallel (dpfast/distributed/kept_call.py) in one call.
//
// A training loop calls the wrapper with the same structure every step. The kept call holds what _plain_batch and
// _tensor_facts (python_many.cpp) read of the last planned call's tensors; a call whose tensors read the same gets
// that call's plan, and only its cut is made anew. Reading both again, comparing them in Python and cutting with
// _narrow_many are four calls and two tuples a step; here the tensors are compared with what was kept in place and
// cut, in one. It answers None whenever it does not match, and Python then reads the call in full and decides: so it
// may only decline more than the full reading would, never accept more.
//
// Returns NotImplemented under a __torch_function__ mode (which must see every tensor call Python makes).
#include "python_kept.h"

#include "plain_tensors.h"
#include "python_many.h"
#include "python_args.h"
#include "python_fast.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace dpfast {
namespace {

// Whether tensor `t` reads as facts[k .. k + dim + 2) say (its sizes, its dtype object, its requires_grad) and as
// the kept _plain_batch read it: a plain tensor on the CPU or CUDA; under an axis (>= 0) a dense one, not
// channels_last, on device `index` (-1: the CPU) with `length` rows from `start` inside it. `k` moves past its facts.
bool reads_as_kept(const at::Tensor& t, PyObject* const* facts, Py_ssize_t n_facts, Py_ssize_t& k, int64_t axis,
                   int64_t index, int64_t start, int64_t length) {
  if (t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || !(t.is_cpu() || t.is_cuda())) {
    return false;
  }
  const int64_t nd = t.dim();
  if (n_facts - k < nd + 2) return false;
  for (int64_t d = 0; d < nd; ++d) {
    int64_t size;
    if (!plain_int(facts[k + d], size) || size != t.size(d)) return false;
  }
  const auto* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  if (facts[k + nd] != dtype || facts[k + nd + 1] != (t.requires_grad() ? Py_True : Py_False)) return false;
  k += nd + 2;
  if (axis < 0) return axis == -1;
  const int64_t device = t.is_cpu() ? -1 : t.get_device();
  // start + length <= size, without overflow: both are >= 0 and size - length is compared instead
  return axis < nd && dense(t) && !maybe_channels_last(t) && device == index &&
         (length < 0 || (length <= t.size(axis) && start <= t.size(axis) - length));
}

// _kept_cut(tensors, facts, axes, index, start, length) -> list | True | None | NotImplemented
//   tensors: a call's tensor leaves; facts: the kept _tensor_facts of the last planned call's; axes and index: the
//   kept _plain_batch's axes (per tensor, -1 to pass it whole) and device index.
//   When every tensor reads as kept: with length >= 0, every tensor with an axis cut to rows [start, start +
//   length) there (narrowed, as _narrow_many cuts), the others the very same objects, in a new list; with length
//   -1 (per-rank inputs, passed as given), True. None when any one reads otherwise.
PyObject* py_kept_cut(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject* const* items;
  PyObject* const* facts;
  Py_ssize_t n, n_facts;
  std::vector<int64_t> axes;
  int64_t index, start, length;
  if (nargs != 6 || at::impl::torch_function_mode_enabled() || !items_of(args[1], facts, n_facts) ||
      !PyTuple_CheckExact(args[1]) || !plain_ints(args[2], axes) || !plain_int(args[3], index) ||
      !plain_int(args[4], start) || !plain_int(args[5], length) || start < 0 || length < -1) {
    return not_implemented();
  }
  // The tensors are borrowed (the facts are a tuple's, which nothing here can change): each is checked and its
  // Tensor taken, and no Python code runs, before anything allocates.
  if (!items_of(args[0], items, n)) return not_implemented();
  if (static_cast<size_t>(n) != axes.size()) Py_RETURN_NONE;
  std::vector<at::Tensor> tensors(static_cast<size_t>(n));
  Py_ssize_t k = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) Py_RETURN_NONE;
    const auto u = static_cast<size_t>(i);
    tensors[u] = THPVariable_Unpack(items[i]);
    if (!reads_as_kept(tensors[u], facts, n_facts, k, axes[u], index, start, length)) Py_RETURN_NONE;
  }
  if (k != n_facts) Py_RETURN_NONE;
  if (length < 0) Py_RETURN_TRUE;
  return cut_to_list(tensors, axes, start, length);  // (python_many.cpp: cut as _narrow_many cuts)
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_kept_cut", DPFAST_FASTCALL(py_kept_cut),
     "a call's tensors checked against the kept call's facts and cut (dpfast/distributed/kept_call.py)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_kept_methods() { return methods; }

}  // namespace dpfast
