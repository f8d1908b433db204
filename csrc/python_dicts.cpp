// dpfast._C._same_dicts and _restore_dicts: the identity checks and restores of a module tree's dicts that every
// DataParallel call with replicas makes (dpfast/run/shallow_snapshots.py), one call each.
//
// A call checks that the module tree is the one its replicas were copied from (every module's __dict__,
// _parameters, _buffers and _modules hold the very same objects), undoes what forwards changed on the copies, and
// in a rehearsal checks after each replica's turn that it did not write to the module. From Python each dict costs
// a few calls and an iteration per entry, and a module's __dict__ has twenty entries.
//
// Only exact dicts are read: PyDict_Next and pointer comparisons run no Python code, and an OrderedDict's order is
// its own (not the dict's). Anything else declines with NotImplemented, and Python does the same work itself.
#include "python_dicts.h"

#include "python_args.h"
#include "python_fast.h"

#include <torch/csrc/Exceptions.h>

#include <cstdint>
#include <vector>

namespace dpfast {
namespace {

// Whether `now` holds exactly the entries of `keys` and `values` (tuples of one length), in order, by identity.
bool holds_exactly(PyObject* now, PyObject* keys, PyObject* values) {
  const Py_ssize_t n = PyTuple_GET_SIZE(keys);
  if (PyDict_GET_SIZE(now) != n) return false;
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;
  while (PyDict_Next(now, &pos, &key, &value)) {
    if (i >= n || key != PyTuple_GET_ITEM(keys, i) || value != PyTuple_GET_ITEM(values, i)) return false;
    ++i;
  }
  return i == n;
}

// Whether the dicts `a` and `b` hold the same entries in the same order, by identity.
bool same_entries(PyObject* a, PyObject* b) {
  if (a == b) return true;
  if (PyDict_GET_SIZE(a) != PyDict_GET_SIZE(b)) return false;
  Py_ssize_t pa = 0, pb = 0;
  PyObject *ka, *va, *kb, *vb;
  while (PyDict_Next(a, &pa, &ka, &va)) {
    if (!PyDict_Next(b, &pb, &kb, &vb) || ka != kb || va != vb) return false;
  }
  return true;
}

// _same_dicts(dicts, keys, values) -> bool | NotImplemented
//   Whether every dicts[i] holds exactly the keys keys[i] (a tuple), in order, each bound to the very object at
//   the same place of values[i]: what dpfast/run/shallow_snapshots.py's `same` tells of one dict, for all of them.
//   NotImplemented for lists of different lengths, or anything but exact lists/tuples, dicts and tuples.
PyObject* py_same_dicts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  PyObject *const *dicts, *const *keys, *const *values;
  Py_ssize_t n, nk, nv;
  if (nargs != 3 || !items_of(args[0], dicts, n) || !items_of(args[1], keys, nk) || !items_of(args[2], values, nv) ||
      nk != n || nv != n) {
    return not_implemented();
  }
  // The items are borrowed: nothing below runs Python code or allocates, so none can be freed meanwhile.
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyDict_CheckExact(dicts[i]) || !PyTuple_CheckExact(keys[i]) || !PyTuple_CheckExact(values[i]) ||
        PyTuple_GET_SIZE(keys[i]) != PyTuple_GET_SIZE(values[i])) {
      return not_implemented();
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!holds_exactly(dicts[i], keys[i], values[i])) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// _restore_dicts(lives, saved) -> None | NotImplemented
//   lives[i].clear(); lives[i].update(saved[i]) for every i, skipped where lives[i] already holds saved[i]'s
//   entries in order by identity (the same result, without releasing and taking every value again). Clearing a
//   dict can run Python code (a value's __del__), which may change the lists: every dict is held first.
//   NotImplemented (nothing changed) for lists of different lengths, or anything but exact lists/tuples of dicts.
PyObject* py_restore_dicts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS  // (a failed reserve must reach Python as MemoryError, not end the process)
  PyObject *const *lives, *const *saved;
  Py_ssize_t n, ns;
  if (nargs != 2 || !items_of(args[0], lives, n) || !items_of(args[1], saved, ns) || ns != n) {
    return not_implemented();
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyDict_CheckExact(lives[i]) || !PyDict_CheckExact(saved[i])) return not_implemented();
  }
  std::vector<THPObjectPtr> held;  // (reserve allocates no Python object, so the items stay borrowed until held)
  held.reserve(2 * static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    Py_INCREF(lives[i]);
    held.emplace_back(lives[i]);
    Py_INCREF(saved[i]);
    held.emplace_back(saved[i]);
  }
  for (size_t i = 0; i < held.size(); i += 2) {
    PyObject* live = held[i].get();
    PyObject* from = held[i + 1].get();
    if (same_entries(live, from)) continue;
    PyDict_Clear(live);
    if (PyDict_Update(live, from) < 0) return nullptr;
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_same_dicts", DPFAST_FASTCALL(py_same_dicts),
     "whether dicts hold exactly their snapshots' entries, by identity (dpfast/run/shallow_snapshots.py)"},
    {"_restore_dicts", DPFAST_FASTCALL(py_restore_dicts),
     "dicts set back to saved copies (dpfast/run/shallow_snapshots.py); NotImplemented to decline"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_dict_methods() { return methods; }

}  // namespace dpfast
