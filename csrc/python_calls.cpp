// Direct CPython entry points for the ops (dpfast._C._transpose01 and friends), used by dpfast/ops.py.
//
// Calling through torch.ops parses every argument into a boxed IValue stack and back, which costs as much as the
// whole copy of a small LSTM state (benchmarks/RESULTS.md, "call path"). These functions take the common case --
// plain tensors (or Parameters), ints, torch.device objects, no __torch_function__ mode -- and call the op's typed
// dispatcher handle, so autograd, dispatch modes and device kernels behave exactly as through torch.ops. Anything
// else (subclasses, modes, odd argument types) returns NotImplemented, and the Python wrapper takes the torch.ops
// path, which handles it and raises the usual errors.
#include "op_handles.h"
#include "python_args.h"
#include "python_calls.h"
#include "python_fast.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace dpfast {
namespace {

// Plain tensors only: a subclass may define __torch_function__, which torch.ops honours and we would skip.
bool plain_tensors(PyObject* const* items, Py_ssize_t n, std::vector<at::Tensor>& out) {
  if (at::impl::torch_function_mode_enabled()) return false;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) return false;
    out.push_back(THPVariable_Unpack(items[i]));
  }
  return true;
}

bool plain_sizes(PyObject* seq, std::vector<c10::SymInt>& out) {
  PyObject* const* items;
  Py_ssize_t n;
  if (!items_of(seq, items, n)) return false;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    int64_t v;
    if (!plain_int(items[i], v)) return false;
    out.emplace_back(v);
  }
  return true;
}

bool plain_devices(PyObject* seq, std::vector<c10::Device>& out) {
  PyObject* const* items;
  Py_ssize_t n;
  if (!items_of(seq, items, n)) return false;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPDevice_Check(items[i])) return false;
    out.push_back(reinterpret_cast<THPDevice*>(items[i])->device);
  }
  return true;
}

// out[i][j] = flat[i * per + j], as Python lists.
PyObject* nested_lists(const char* op, std::vector<at::Tensor>&& flat, size_t rows, size_t per) {
  check_output_count(op, flat.size(), rows * per);
  PyObject* outer = PyList_New(static_cast<Py_ssize_t>(rows));
  if (outer == nullptr) return nullptr;
  for (size_t i = 0; i < rows; ++i) {
    PyObject* inner = PyList_New(static_cast<Py_ssize_t>(per));
    if (inner == nullptr) {
      Py_DECREF(outer);
      return nullptr;
    }
    PyList_SET_ITEM(outer, static_cast<Py_ssize_t>(i), inner);
    for (size_t j = 0; j < per; ++j) {
      PyObject* t = THPVariable_Wrap(std::move(flat[i * per + j]));
      if (t == nullptr) {
        Py_DECREF(outer);
        return nullptr;
      }
      PyList_SET_ITEM(inner, static_cast<Py_ssize_t>(j), t);
    }
  }
  return outer;
}

// _transpose01(*tensors) -> tuple
PyObject* py_transpose01(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs == 0) return PyTuple_New(0);
  std::vector<at::Tensor> xs;
  if (!plain_tensors(args, nargs, xs)) return not_implemented();
  std::vector<at::Tensor> outs;
  {
    ReleaseGil nogil;
    outs = transpose01_op().call(xs);
  }
  check_output_count("transpose01", outs.size(), xs.size());
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(outs.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < outs.size(); ++i) {
    PyObject* t = THPVariable_Wrap(std::move(outs[i]));
    if (t == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), t);
  }
  return tuple;
  END_HANDLE_TH_ERRORS
}

// (tensors, dim, sizes, ...) of split_contiguous and scatter, when all are plain.
bool plain_split_args(PyObject* const* args, std::vector<at::Tensor>& xs, int64_t& dim,
                      std::vector<c10::SymInt>& sizes) {
  PyObject* const* items;
  Py_ssize_t n;
  return items_of(args[0], items, n) && n > 0 && plain_tensors(items, n, xs) && plain_int(args[1], dim) &&
         plain_sizes(args[2], sizes);
}

// _split_contiguous(tensors, dim, sizes) -> list[list[Tensor]]
PyObject* py_split_contiguous(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> xs;
  int64_t dim;
  std::vector<c10::SymInt> sizes;
  if (nargs != 3 || !plain_split_args(args, xs, dim, sizes)) {
    PyErr_Clear();
    return not_implemented();
  }
  std::vector<at::Tensor> outs;
  {
    ReleaseGil nogil;
    outs = split_op().call(xs, dim, sizes);
  }
  return nested_lists("split_contiguous", std::move(outs), xs.size(), sizes.size());
  END_HANDLE_TH_ERRORS
}

// _scatter(tensors, dim, sizes, devices) -> list[list[Tensor]]
PyObject* py_scatter(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> xs;
  int64_t dim;
  std::vector<c10::SymInt> sizes;
  std::vector<c10::Device> devices;
  if (nargs != 4 || !plain_split_args(args, xs, dim, sizes) || !plain_devices(args[3], devices)) {
    PyErr_Clear();
    return not_implemented();
  }
  std::vector<at::Tensor> outs;
  {
    ReleaseGil nogil;
    outs = scatter_op().call(xs, dim, sizes, devices);
  }
  return nested_lists("scatter", std::move(outs), xs.size(), sizes.size());
  END_HANDLE_TH_ERRORS
}

// _gather(chunks, dim, device) -> Tensor
PyObject* py_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject* const* items;
  Py_ssize_t n;
  std::vector<at::Tensor> chunks;
  int64_t dim;
  if (nargs != 3 || !items_of(args[0], items, n) || n == 0 || !plain_tensors(items, n, chunks) ||
      !plain_int(args[1], dim) || !THPDevice_Check(args[2])) {
    PyErr_Clear();
    return not_implemented();
  }
  const c10::Device device = reinterpret_cast<THPDevice*>(args[2])->device;
  at::Tensor out;
  {
    ReleaseGil nogil;
    out = gather_op().call(chunks, dim, device);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_transpose01", DPFAST_FASTCALL(py_transpose01), "transpose01 for plain tensors; NotImplemented otherwise"},
    {"_split_contiguous", DPFAST_FASTCALL(py_split_contiguous),
     "split_contiguous for plain arguments; NotImplemented otherwise"},
    {"_scatter", DPFAST_FASTCALL(py_scatter), "scatter for plain arguments; NotImplemented otherwise"},
    {"_gather", DPFAST_FASTCALL(py_gather), "gather for plain arguments; NotImplemented otherwise"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_call_methods() { return methods; }

}  // namespace dpfast
