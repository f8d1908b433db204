// Argument parsing shared by the private CPython entry points (python_hooks.cpp, python_costs.cpp) and the method
// tables of all three entry-point files.
#pragma once

#include <Python.h>
#include <torch/csrc/Exceptions.h>

#include <cstdint>
#include <vector>

// A METH_FASTCALL function as a PyMethodDef's (function, flags) pair.
#define DPFAST_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f)), METH_FASTCALL

namespace dpfast {

// A list or tuple as a vector of borrowed items; raises TypeError naming `what` for anything else.
inline std::vector<PyObject*> sequence_items(PyObject* seq, const char* what) {
  TORCH_CHECK_TYPE(PyList_Check(seq) || PyTuple_Check(seq), what, " must be a list or tuple");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** raw = PySequence_Fast_ITEMS(seq);
  return std::vector<PyObject*>(raw, raw + n);
}

// An int (or an object with __index__) that fits in int64, else a TypeError/ValueError naming `what` (never an
// OverflowError).
inline int64_t as_int64(PyObject* o, const char* what) {
  TORCH_CHECK_TYPE(PyIndex_Check(o), what, " must be an int");
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (v == -1 && PyErr_Occurred()) throw python_error();
  TORCH_CHECK_VALUE(overflow == 0, what, " is out of range");
  return v;
}

inline std::vector<int64_t> int_list(PyObject* seq, const char* what) {
  std::vector<int64_t> out;
  for (PyObject* o : sequence_items(seq, what)) out.push_back(as_int64(o, what));
  return out;
}

}  // namespace dpfast
