// Readers shared by the fast entry points (python_calls.cpp, python_many.cpp, python_dicts.cpp): exact types
// only.
// Each check is a type comparison that runs no Python code, so a list's items may be borrowed while they are read,
// unlike in python_args.h; anything else is declined (NotImplemented), and the Python wrapper takes its own path.
// Nothing that may run Python code (an allocation of a GC-tracked object can run a collection) may come between
// borrowing the items and reading the last one.
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

namespace dpfast {

// Releases the GIL while an op runs, as torch's own bindings do, so other threads (replicas) run meanwhile.
struct ReleaseGil {
  PyThreadState* state = PyEval_SaveThread();
  ~ReleaseGil() { PyEval_RestoreThread(state); }
};

inline PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

// The items of an exact list or tuple (borrowed), or false for anything else.
inline bool items_of(PyObject* seq, PyObject* const*& items, Py_ssize_t& n) {
  if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return false;
  items = reinterpret_cast<PyObject* const*>(PySequence_Fast_ITEMS(seq));
  n = PySequence_Fast_GET_SIZE(seq);
  return true;
}

// An exact int in int64 range (bool and int subclasses are declined).
inline bool plain_int(PyObject* obj, int64_t& out) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (out == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return overflow == 0;
}

inline bool plain_ints(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* const* items;
  Py_ssize_t n;
  if (!items_of(seq, items, n)) return false;
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!plain_int(items[i], out[static_cast<size_t>(i)])) return false;
  }
  return true;
}

// A new Python list of `values` (nullptr, with the error set, if an allocation fails).
inline PyObject* int_list_object(const std::vector<int64_t>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), v);
  }
  return list;
}

}  // namespace dpfast
