// dpfast._C._pack_payload, _int_rows and _blocks: DistributedDataParallel's output exchange
// (dpfast/distributed/outputs.py, gather_outputs=True) in one call from Python each: the bytes one rank sends, the
// headers every rank sent, and every tensor's part of the gathered bytes.
//
// Python does each with a slice, views and a copy per tensor: each a Python call that costs several microseconds
// inside a training step (benchmarks/RESULTS.md). Here the same ops run through the dispatcher without Python
// between them. Every offset and size comes from Python's layout, and is checked again before anything is made: a
// buffer never grows past `size`, and nothing is written or read outside it or misaligned for its dtype. Anything
// unusual is declined (NotImplemented) and Python does it.
#include "python_exchange.h"

#include "overflow.h"
#include "python_args.h"
#include "python_fast.h"

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/GradMode.h>
#include <c10/util/safe_numerics.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
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
    c10::AutoGradMode no_grad(false);  // the bytes sent are no part of any graph (Exchange connects the outputs)
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

// The gathered bytes: an exact, plain, contiguous (world, width) uint8 tensor.
bool gathered_bytes(PyObject* obj, at::Tensor& out) {
  if (!THPVariable_CheckExact(obj)) return false;
  out = THPVariable_Unpack(obj);
  return out.layout() == at::kStrided && !out.is_nested() && !out.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
         out.scalar_type() == at::kByte && out.dim() == 2 && out.is_contiguous();
}

// _int_rows(gathered, count) -> list[list[int]] | NotImplemented
//   The first `count` int64 of every row of `gathered` (the ranks' headers), as Python lists: what
//   gathered[:, :8 * count].view(torch.int64).tolist() gives, in one call (one device-to-host copy on CUDA).
//   NotImplemented unless each row holds `count` of them, aligned (its width and start multiples of 8).
PyObject* py_int_rows(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  at::Tensor gathered;
  int64_t count;
  if (nargs != 2 || at::impl::torch_function_mode_enabled() || !gathered_bytes(args[0], gathered) ||
      !plain_int(args[1], count) || count < 0 || count > gathered.size(1) / 8 || gathered.size(1) % 8 != 0 ||
      gathered.storage_offset() % 8 != 0) {
    return not_implemented();
  }
  const int64_t world = gathered.size(0);
  std::vector<int64_t> values(static_cast<size_t>(world * count));  // (world * count * 8 bytes lie in `gathered`)
  if (!values.empty()) {
    ReleaseGil nogil;
    c10::AutoGradMode no_grad(false);
    at::Tensor host = at::from_blob(values.data(), {world, count}, at::TensorOptions().dtype(at::kLong));
    host.copy_(gathered.narrow(1, 0, 8 * count).view(at::kLong));
  }
  const int64_t* data = values.data();
  THPObjectPtr rows(PyList_New(world));
  if (!rows) return nullptr;
  for (int64_t r = 0; r < world; ++r) {
    PyObject* row = int_list_object(std::vector<int64_t>(data + r * count, data + (r + 1) * count));
    if (row == nullptr) return nullptr;
    PyList_SET_ITEM(rows.get(), r, row);
  }
  return rows.release();
  END_HANDLE_TH_ERRORS
}

// One tensor's part of every rank's payload: `shape` (of its dtype) at byte `pos` of each row.
struct Block {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t pos = 0;
  int64_t nbytes = 0;
  bool rows = false;  // a "cat" tensor: every rank's rows one after the other (else stacked: (world, *shape))
};

bool read_block(PyObject* dtype, PyObject* shape, PyObject* offset, PyObject* rows, int64_t base, Block& b) {
  PyObject* const* dims;
  Py_ssize_t nd;
  int64_t off;
  if (!THPDtype_Check(dtype) || !items_of(shape, dims, nd) || !plain_int(offset, off) || off < 0 ||
      !PyBool_Check(rows) || add_overflows(base, off, &b.pos)) {
    return false;
  }
  b.dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  b.rows = rows == Py_True;
  int64_t numel = 1;
  for (Py_ssize_t k = 0; k < nd; ++k) {
    int64_t d;
    if (!plain_int(dims[k], d) || d < 0 || c10::mul_overflows(numel, d, &numel)) return false;
    b.shape.push_back(d);
  }
  if (b.rows && nd == 0) return false;
  const auto item = static_cast<int64_t>(c10::elementSize(b.dtype));
  return !c10::mul_overflows(numel, item, &b.nbytes);
}

// _blocks(gathered, base, dtypes, shapes, offsets, rows) -> list[Tensor] | NotImplemented
//   Every rank sent the same placement: tensor i's part is shapes[i] of dtypes[i] at byte base + offsets[i] of each
//   row of `gathered`. rows[i] True ("cat"): every rank's rows one after the other, (world * shape[0], ...) (a
//   view with one rank, else a copy); False: stacked, (world, *shape), a view. NotImplemented unless every part
//   lies inside a row, aligned for its dtype (the row's width too), and no __torch_function__ mode is on.
PyObject* py_blocks(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  at::Tensor gathered;
  int64_t base;
  PyObject *const *dtypes, *const *shapes, *const *offsets, *const *rows;
  Py_ssize_t n, n_shapes, n_offsets, n_rows;
  if (nargs != 6 || at::impl::torch_function_mode_enabled() || !gathered_bytes(args[0], gathered) ||
      !plain_int(args[1], base) || base < 0 || !items_of(args[2], dtypes, n) || !items_of(args[3], shapes, n_shapes) ||
      !items_of(args[4], offsets, n_offsets) || !items_of(args[5], rows, n_rows) || n != n_shapes || n != n_offsets ||
      n != n_rows) {
    return not_implemented();
  }
  const int64_t world = gathered.size(0), width = gathered.size(1);
  // Each item is read (exact types: no Python code runs) before anything allocates; a shape's tuple is borrowed
  // from its list too, and read at once.
  std::vector<Block> blocks(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    Block& b = blocks[static_cast<size_t>(i)];
    if (!read_block(dtypes[i], shapes[i], offsets[i], rows[i], base, b)) return not_implemented();
    const auto item = static_cast<int64_t>(c10::elementSize(b.dtype));
    int64_t merged;
    if (b.nbytes > width || b.pos > width - b.nbytes || b.pos % item != 0 || width % item != 0 ||
        gathered.storage_offset() % item != 0 || (b.rows && c10::mul_overflows(world, b.shape[0], &merged))) {
      return not_implemented();
    }
  }
  std::vector<at::Tensor> outs(blocks.size());
  {
    ReleaseGil nogil;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Block& b = blocks[i];
      std::vector<int64_t> stacked{world};
      stacked.insert(stacked.end(), b.shape.begin(), b.shape.end());
      at::Tensor part = gathered.narrow(1, b.pos, b.nbytes).view(b.dtype).view(stacked);
      if (b.rows) {
        std::vector<int64_t> merged(b.shape);
        merged[0] *= world;  // (checked above)
        part = part.reshape(merged);
      }
      outs[i] = std::move(part);
    }
  }
  THPObjectPtr list(PyList_New(n));
  if (!list) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = THPVariable_Wrap(std::move(outs[static_cast<size_t>(i)]));
    if (t == nullptr) return nullptr;
    PyList_SET_ITEM(list.get(), i, t);
  }
  return list.release();
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_pack_payload", DPFAST_FASTCALL(py_pack_payload),
     "the bytes of one rank's output exchange (dpfast/distributed/outputs.py); NotImplemented to decline"},
    {"_int_rows", DPFAST_FASTCALL(py_int_rows), "the headers of every rank's gathered bytes, as lists of ints"},
    {"_blocks", DPFAST_FASTCALL(py_blocks), "every output tensor's part of the gathered bytes, one block each"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_exchange_methods() { return methods; }

}  // namespace dpfast
