// dpfast._C._pack_payload: the bytes one rank sends in DistributedDataParallel's output exchange
// (dpfast/distributed/outputs.py, gather_outputs=True), made in one call from Python.
//
// Python writes them with a zeroed buffer, a tensor of the header's ints and, per output tensor, a slice, two views
// and a copy: each a Python call that costs several microseconds inside a training step (benchmarks/RESULTS.md).
// Here the same ops run through the dispatcher without Python between them. Every offset and size comes from
// Python's layout, and is checked again before any copy: a buffer never grows past `size`, and nothing is written
// outside it or misaligned for its dtype. Anything unusual is declined (NotImplemented) and Python writes it.
#include "python_exchange.h"

#include "overflow.h"
#include "python_args.h"
#include "python_fast.h"

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/safe_numerics.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <vector>

namespace dpfast {
namespace {

// One output tensor to write: its rows go along `axis` (moved to the front) and its bytes at `pos`.
struct Piece {
  at::Tensor t;
  int64_t axis = 0;
  int64_t pos = 0;
  int64_t nbytes = 0;
};

// Whether `p` (a plain dense tensor) fits in a buffer of `size` bytes at `base + offset`, aligned for its dtype.
bool placed(Piece& p, int64_t offset, int64_t base, int64_t size) {
  const at::Tensor& t = p.t;
  if (!t.defined() || t.layout() != at::kStrided || t.is_nested() || t.is_quantized() ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const int64_t nd = t.dim();
  if (p.axis < 0 || (nd > 0 && p.axis >= nd) || (nd == 0 && p.axis != 0)) return false;
  const auto item = static_cast<int64_t>(t.element_size());
  if (item <= 0 || c10::mul_overflows(t.numel(), item, &p.nbytes)) return false;
  if (offset < 0 || add_overflows(base, offset, &p.pos)) return false;
  return p.pos % item == 0 && p.nbytes <= size && p.pos <= size - p.nbytes;
}

// `t` with its rows along axis 0 (a 0-dim tensor: one row), as a view of the buffer's bytes at `pos` takes them.
std::vector<int64_t> rows_first(const at::Tensor& t, int64_t axis) {
  std::vector<int64_t> shape;
  if (t.dim() == 0) return {1};
  shape.push_back(t.size(axis));
  for (int64_t k = 0; k < t.dim(); ++k) {
    if (k != axis) shape.push_back(t.size(k));
  }
  return shape;
}

// _pack_payload(size, device, ints, tensors, axes, offsets, base) -> Tensor | NotImplemented
//   A zeroed uint8 tensor of `size` bytes on `device`: `ints` as int64 from byte 0, then each tensor's bytes at
//   `base + offsets[i]` with its axis `axes[i]` moved to the front (0: as it is). NotImplemented, and nothing
//   made, unless every argument is of its exact type, every tensor a plain dense one whose bytes fit the buffer at
//   a position aligned for its dtype, and no __torch_function__ mode is on (it must see each op).
PyObject* py_pack_payload(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  int64_t size, base;
  std::vector<int64_t> ints, axes, offsets;
  PyObject* const* items;
  Py_ssize_t n;
  if (nargs != 7 || at::impl::torch_function_mode_enabled() || !plain_int(args[0], size) || size < 0 ||
      !THPDevice_Check(args[1]) || !plain_ints(args[2], ints) || !plain_ints(args[4], axes) ||
      !plain_ints(args[5], offsets) || !plain_int(args[6], base) || base < 0 ||
      static_cast<uint64_t>(ints.size()) > static_cast<uint64_t>(size / 8) || !items_of(args[3], items, n) ||
      static_cast<size_t>(n) != axes.size() || axes.size() != offsets.size()) {
    return not_implemented();
  }
  const c10::Device device = reinterpret_cast<THPDevice*>(args[1])->device;
  // The items are borrowed: each is checked and its Tensor taken (no Python code runs) before anything allocates.
  std::vector<Piece> pieces(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) return not_implemented();
    pieces[static_cast<size_t>(i)].t = THPVariable_Unpack(items[i]);
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    pieces[i].axis = axes[i];
    if (!placed(pieces[i], offsets[i], base, size)) return not_implemented();
  }
  at::Tensor buf;
  {
    ReleaseGil nogil;
    at::NoGradGuard no_grad;  // the bytes sent are no part of any graph (Exchange connects the outputs)
    buf = at::zeros({size}, at::TensorOptions().dtype(at::kByte).device(device));
    if (!ints.empty()) {
      const auto count = static_cast<int64_t>(ints.size());
      at::Tensor host = at::from_blob(ints.data(), {count}, at::TensorOptions().dtype(at::kLong));
      buf.narrow(0, 0, 8 * count).view(at::kLong).copy_(host);
    }
    for (const Piece& p : pieces) {
      if (p.nbytes == 0) continue;
      at::Tensor dst = buf.narrow(0, p.pos, p.nbytes).view(p.t.scalar_type()).view(rows_first(p.t, p.axis));
      dst.copy_(p.axis == 0 ? p.t : p.t.movedim(p.axis, 0));
    }
  }
  return THPVariable_Wrap(std::move(buf));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_pack_payload", DPFAST_FASTCALL(py_pack_payload),
     "the bytes of one rank's output exchange (dpfast/distributed/outputs.py); NotImplemented to decline"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_exchange_methods() { return methods; }

}  // namespace dpfast
