// Argument parsing shared by the private CPython entry points (python_costs.cpp, testing/python_hooks.cpp) and
// the method tables of all the entry-point files.
//
// Reading an argument may run Python code: an int-like item's __index__, the __class__ lookup of isinstance. That
// code can mutate or free what is being read, so nothing here keeps a borrowed pointer across such a call: a
// list's items are read from a tuple that holds a reference to each, and tensors are recognised by their real type
// alone, which runs no Python code (and cannot be fooled by a __class__ property claiming to be a Tensor).
#pragma once

#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <cstdint>
#include <vector>

// A METH_FASTCALL function as a PyMethodDef's (function, flags) pair.
#define DPFAST_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&f)), METH_FASTCALL

namespace dpfast {

// The items of a list or tuple as they are now, each held for the lifetime of this object; a TypeError naming
// `what` for anything else.
class HeldItems {
 public:
  HeldItems(PyObject* seq, const char* what) {
    TORCH_CHECK_TYPE(PyList_Check(seq) || PyTuple_Check(seq), what, " must be a list or tuple");
    if (PyTuple_Check(seq)) Py_INCREF(seq);  // immutable: its items live as long as it does
    items_ = THPObjectPtr(PyTuple_Check(seq) ? seq : PyList_AsTuple(seq));
    if (!items_) throw python_error();
  }
  size_t size() const { return static_cast<size_t>(PyTuple_GET_SIZE(items_.get())); }
  PyObject* operator[](size_t i) const { return PyTuple_GET_ITEM(items_.get(), static_cast<Py_ssize_t>(i)); }

 private:
  THPObjectPtr items_;
};

// A torch.Tensor or an instance of a subclass, by the object's real type.
inline bool is_tensor(PyObject* o) {
  return THPVariableClass != nullptr && PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

inline at::Tensor unpack_tensor(PyObject* o, const char* what) {
  TORCH_CHECK_TYPE(is_tensor(o), what, " must be a Tensor");
  return THPVariable_Unpack(o);
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

// Take every list argument as HeldItems before converting any: an item's __index__ could change a list read later.
inline std::vector<int64_t> int_list(const HeldItems& items, const char* what) {
  std::vector<int64_t> out;
  out.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) out.push_back(as_int64(items[i], what));
  return out;
}

}  // namespace dpfast
