// dpfast._C._gather_many, _narrow_many, _leaf_facts and _batch_size: a call's per-leaf work, in one call from
// Python each.
//
// Called leaf by leaf from Python, each small leaf pays a Python call, argument conversion and a result's wrapping,
// which is most of the work for small tensors (benchmarks/RESULTS.md, "overhead").
//
// _gather_many gathers a call's output leaves (dpfast/move/gather.py): it calls the very same dpfast::gather op
// through its typed dispatcher handle (so autograd, dispatch modes and device kernels are those of
// dpfast.ops.gather) for each leaf that is plain: plain dense tensors (no subclass, nested, quantized or sparse one)
// agreeing in dtype, rank and every dim but the gathered one, replica 0's not channels_last. Every other leaf comes
// back as None, and Python gathers it on its own path, with its own checks and messages.
//
// _narrow_many cuts a DistributedDataParallel call's tensor leaves to this rank's rows
// (dpfast/distributed/sharding.py), one narrow each through the dispatcher; _leaf_facts reads what a call's key
// holds of its plain tensor leaves (dpfast/trees/facts.py), and _batch_size the sizes its program checks agree
// (dpfast/plan/program.py).
//
// All return NotImplemented under a __torch_function__ mode (which must see every tensor call Python makes).
#include "python_many.h"

#include "op_handles.h"
#include "plain_tensors.h"
#include "python_args.h"
#include "python_fast.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <exception>
#include <vector>

namespace dpfast {
namespace {

// One leaf: its chunks (one per replica) and the dim to concatenate; `plain` until a check says otherwise.
struct Leaf {
  std::vector<at::Tensor> chunks;
  int64_t dim = 0;
  bool plain = true;
  bool follows = true;  // the chunks' sizes along dim are the call's chunk sizes (else Python may warn)
  at::Tensor out;
};

// Leaf i's chunks are columns[r][i] for every replica r: plain Tensors (or Parameters, which CheckExact takes too).
bool unpack(PyObject* const* columns, size_t replicas, std::vector<Leaf>& leaves) {
  for (size_t r = 0; r < replicas; ++r) {
    PyObject* const* items;
    Py_ssize_t n;
    if (!items_of(columns[r], items, n) || static_cast<size_t>(n) != leaves.size()) return false;
    for (size_t i = 0; i < leaves.size(); ++i) {
      Leaf& leaf = leaves[i];
      if (!leaf.plain) continue;
      if (!THPVariable_CheckExact(items[i])) {
        leaf.plain = false;
        continue;
      }
      leaf.chunks.push_back(THPVariable_Unpack(items[i]));
    }
  }
  return true;
}

// What dpfast/move/gather.py's own path would hand to ops.gather unchanged: dense chunks of one dtype and rank that
// agree in every dim but `dim` (then wrapped), replica 0's not (maybe) channels_last (that path gathers its NHWC view).
bool plain_leaf(Leaf& leaf) {
  const at::Tensor& ref = leaf.chunks[0];
  if (!dense(ref) || ref.dim() == 0) return false;
  const int64_t nd = ref.dim();
  if (leaf.dim < -nd || leaf.dim >= nd) return false;
  leaf.dim = leaf.dim < 0 ? leaf.dim + nd : leaf.dim;
  if (maybe_channels_last(ref)) return false;
  for (const at::Tensor& c : leaf.chunks) {
    if (!dense(c) || c.dim() != nd || c.scalar_type() != ref.scalar_type()) return false;
    for (int64_t k = 0; k < nd; ++k) {
      if (k != leaf.dim && c.size(k) != ref.size(k)) return false;
    }
  }
  return true;
}

bool sizes_follow(const Leaf& leaf, const std::vector<int64_t>& sizes) {
  if (leaf.chunks.size() < 2 || leaf.chunks.size() != sizes.size()) return true;  // (Python checks no further)
  for (size_t j = 0; j < sizes.size(); ++j) {
    if (leaf.chunks[j].size(leaf.dim) != sizes[j]) return false;
  }
  return true;
}

// Gathers every plain leaf; a leaf whose gather raises is left to Python, which raises it again, worded for the
// output (a meta chunk, a device torch cannot use).
void gather_plain(std::vector<Leaf>& leaves, const c10::Device& device, const std::vector<int64_t>& sizes) {
  for (Leaf& leaf : leaves) {
    if (!leaf.plain) continue;
    try {
      leaf.out = gather_op().call(leaf.chunks, leaf.dim, device);
      leaf.follows = sizes_follow(leaf, sizes);
    } catch (const std::exception&) {
      leaf.plain = false;
    }
    leaf.chunks.clear();  // each chunk's memory may go as soon as its leaf is gathered
  }
}

PyObject* results(std::vector<Leaf>& leaves) {
  const auto n = static_cast<Py_ssize_t>(leaves.size());
  PyObject* outs = PyList_New(n);
  PyObject* follows = PyList_New(n);
  if (outs == nullptr || follows == nullptr) {
    Py_XDECREF(outs);
    Py_XDECREF(follows);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    Leaf& leaf = leaves[static_cast<size_t>(i)];
    PyObject* t = Py_None;
    if (leaf.plain) {
      t = THPVariable_Wrap(std::move(leaf.out));
      if (t == nullptr) {
        Py_DECREF(outs);
        Py_DECREF(follows);
        return nullptr;
      }
    } else {
      Py_INCREF(Py_None);
    }
    PyList_SET_ITEM(outs, i, t);
    PyObject* flag = leaf.follows ? Py_True : Py_False;
    Py_INCREF(flag);
    PyList_SET_ITEM(follows, i, flag);
  }
  bool all = true;
  for (const Leaf& leaf : leaves) all = all && leaf.plain && leaf.follows;
  PyObject* triple = PyTuple_Pack(3, outs, follows, all ? Py_True : Py_False);
  Py_DECREF(outs);
  Py_DECREF(follows);
  return triple;
}

// _gather_many(columns, dims, device, sizes) -> (outs, follows, all_done) | NotImplemented
//   columns: per replica, its output leaves (one list each, all of one length); dims: per leaf, the dim to
//   concatenate; device: where the results go; sizes: the call's chunk sizes, for `follows`.
//   outs[i]: leaf i gathered, or None where Python must gather it itself; follows[i]: whether leaf i's chunks are
//   `sizes` long along their dim (only then is there nothing to warn about); all_done: every leaf gathered and
//   following.
PyObject* py_gather_many(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject* const* columns;
  Py_ssize_t replicas;
  std::vector<int64_t> dims, sizes;
  if (nargs != 4 || at::impl::torch_function_mode_enabled() || !items_of(args[0], columns, replicas) ||
      replicas == 0 || !plain_ints(args[1], dims) || !THPDevice_Check(args[2]) || !plain_ints(args[3], sizes)) {
    return not_implemented();
  }
  // every column is a list or tuple of one length per leaf before anything is sized by their counts
  for (Py_ssize_t r = 0; r < replicas; ++r) {
    PyObject* const* items;
    Py_ssize_t n;
    if (!items_of(columns[r], items, n) || static_cast<size_t>(n) != dims.size()) return not_implemented();
  }
  const c10::Device device = reinterpret_cast<THPDevice*>(args[2])->device;
  std::vector<Leaf> leaves(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    leaves[i].dim = dims[i];
    leaves[i].chunks.reserve(static_cast<size_t>(replicas));
  }
  if (!unpack(columns, static_cast<size_t>(replicas), leaves)) return not_implemented();
  for (Leaf& leaf : leaves) leaf.plain = leaf.plain && plain_leaf(leaf);
  {
    ReleaseGil nogil;
    gather_plain(leaves, device, sizes);
  }
  return results(leaves);
  END_HANDLE_TH_ERRORS
}

// Tensor `t` cut to rows [start, start + length) along `axis`, as dpfast/distributed/sharding.py's _narrowed does:
// a view along axis 0, else a contiguous copy (through the dispatcher: autograd and dispatch modes see each op).
at::Tensor narrowed(const at::Tensor& t, int64_t axis, int64_t start, int64_t length) {
  at::Tensor v = t.narrow(axis, start, length);
  return axis == 0 ? v : v.contiguous();
}

// The tensors cut (axes[i] != -1) as a new Python list; the uncut ones are the very objects.
PyObject* cut_to_list(std::vector<at::Tensor>& tensors, const std::vector<int64_t>& axes, int64_t start,
                      int64_t length) {
  {
    ReleaseGil nogil;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (axes[i] != -1) tensors[i] = narrowed(tensors[i], axes[i], start, length);
    }
  }
  const auto n = static_cast<Py_ssize_t>(tensors.size());
  THPObjectPtr list(PyList_New(n));  // (freed if a wrap fails or throws)
  if (!list) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = THPVariable_Wrap(std::move(tensors[static_cast<size_t>(i)]));  // an uncut one: its own object
    if (t == nullptr) return nullptr;
    PyList_SET_ITEM(list.get(), i, t);
  }
  return list.release();
}

// _narrow_many(tensors, axes, start, length) -> list | NotImplemented
//   tensors: a call's tensor leaves; axes: per tensor, the axis to cut (counted from the front), or -1 to pass it
//   as it is. Every tensor with an axis cut to rows [start, start + length) there (see narrowed above), the others
//   the very same objects. NotImplemented (the caller narrows in Python, and raises what is wrong) unless every item
//   is a Tensor, every cut one a plain dense one with concrete sizes, every axis -1 or one of its tensor's, and the
//   rows inside every cut tensor.
PyObject* py_narrow_many(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject* const* items;
  Py_ssize_t n;
  std::vector<int64_t> axes;
  int64_t start, length;
  if (nargs != 4 || at::impl::torch_function_mode_enabled() || !items_of(args[0], items, n) ||
      !plain_ints(args[1], axes) || static_cast<size_t>(n) != axes.size() || !plain_int(args[2], start) ||
      !plain_int(args[3], length) || start < 0 || length < 0) {
    return not_implemented();
  }
  // The items are borrowed: each is checked and its Tensor taken (no Python code runs) before anything allocates.
  std::vector<at::Tensor> tensors(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) return not_implemented();
    tensors[static_cast<size_t>(i)] = THPVariable_Unpack(items[i]);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t axis = axes[i];
    if (axis == -1) continue;
    // start + length <= size, without overflow: both are >= 0 and size - length is compared instead
    if (!dense(t) || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || axis < 0 || axis >= t.dim() ||
        length > t.size(axis) || start > t.size(axis) - length) {
      return not_implemented();
    }
  }
  return cut_to_list(tensors, axes, start, length);
  END_HANDLE_TH_ERRORS
}

// _leaf_facts(leaves) -> (codes, others) | NotImplemented
//   leaves: a call's leaf values, in order. What dpfast/trees/facts.py's leaf_facts reads of them for the call's
//   key, in one call: `codes` holds 4 bytes per leaf, for a plain tensor (an exact Tensor, dense, not nested or
//   quantized, on the CPU or CUDA, of 1 to 255 dims other than 4 and 5, whose memory format Python reads) its
//   dtype + 1, dims and flags (requires_grad, CUDA, and 1 to mark it), zeros for any other leaf; `others` lists
//   the positions of those, whose facts Python reads. Two plain tensors get the same code exactly when
//   tensor_fact gives them the same facts.
PyObject* py_leaf_facts(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject* const* items;
  Py_ssize_t n;
  if (nargs != 1 || at::impl::torch_function_mode_enabled() || !items_of(args[0], items, n) ||
      n > PY_SSIZE_T_MAX / 4) {
    return not_implemented();
  }
  // The items are borrowed: every one is read before anything allocates (the bytes, the list)
  std::vector<uint8_t> codes(static_cast<size_t>(n) * 4, 0);
  std::vector<int64_t> others;
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint8_t* code = codes.data() + 4 * i;
    // an exact Tensor (not a Parameter, which THPVariable_CheckExact takes too: its type is a fact of its own)
    bool plain = Py_TYPE(items[i]) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
    if (plain) {
      const at::Tensor& t = THPVariable_Unpack(items[i]);
      const int64_t nd = t.dim();
      plain = dense(t) && (t.is_cpu() || t.is_cuda()) && nd >= 1 && nd <= 255 && nd != 4 && nd != 5;
      if (plain) {
        code[0] = static_cast<uint8_t>(static_cast<int>(t.scalar_type()) + 1);
        code[1] = static_cast<uint8_t>(nd);
        code[2] = static_cast<uint8_t>(1 | (t.requires_grad() ? 2 : 0) | (t.is_cuda() ? 4 : 0));
      }
    }
    if (!plain) others.push_back(i);
  }
  THPObjectPtr bytes(PyBytes_FromStringAndSize(reinterpret_cast<const char*>(codes.data()),
                                               static_cast<Py_ssize_t>(codes.size())));
  if (!bytes) return nullptr;
  THPObjectPtr list(int_list_object(others));
  if (!list) return nullptr;
  return PyTuple_Pack(2, bytes.get(), list.get());
  END_HANDLE_TH_ERRORS
}

// _batch_size(leaves, where, axes) -> int | None | NotImplemented
//   leaves: a call's leaf values; where: the positions of the tensors its program splits; axes: their batch axes
//   (counted from the front). Their common size along those axes, or None when they differ (Python's own check
//   then raises the ScatterError that says where). NotImplemented (Python reads the sizes) for anything but exact
//   Tensors with concrete sizes that have those axes, and under a __torch_function__ mode.
PyObject* py_batch_size(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  PyObject* const* items;
  Py_ssize_t n;
  std::vector<int64_t> where, axes;
  if (nargs != 3 || at::impl::torch_function_mode_enabled() || !items_of(args[0], items, n) ||
      !plain_ints(args[1], where) || !plain_ints(args[2], axes) || where.size() != axes.size() || where.empty()) {
    return not_implemented();
  }
  int64_t batch = -1;
  bool agree = true;
  for (size_t k = 0; k < where.size(); ++k) {
    const int64_t i = where[k];
    if (i < 0 || i >= n || !THPVariable_CheckExact(items[i])) return not_implemented();
    const at::Tensor& t = THPVariable_Unpack(items[i]);
    if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || axes[k] < 0 || axes[k] >= t.dim()) {
      return not_implemented();
    }
    const int64_t size = t.size(axes[k]);
    agree = agree && (batch < 0 || size == batch);
    batch = size;
  }
  if (!agree) Py_RETURN_NONE;
  return PyLong_FromLongLong(batch);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_gather_many", DPFAST_FASTCALL(py_gather_many),
     "the gathers of many output leaves (dpfast/move/gather.py); None for a leaf it leaves to Python"},
    {"_narrow_many", DPFAST_FASTCALL(py_narrow_many),
     "a call's tensor leaves cut to one rank's rows (dpfast/distributed/sharding.py); NotImplemented to decline"},
    {"_batch_size", DPFAST_FASTCALL(py_batch_size),
     "the common size of a call's split tensors along their axes (dpfast/plan/program.py); None if they differ"},
    {"_leaf_facts", DPFAST_FASTCALL(py_leaf_facts),
     "a call's plain tensor leaves' facts, 4 bytes each, and the positions of the others (dpfast/trees/facts.py)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_many_methods() { return methods; }

}  // namespace dpfast
