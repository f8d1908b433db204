// dpfast._C_hooks, the tests' entry points into the C++ (_side_stream_devices and friends): the decisions and the
// index walk of the CUDA paths, run on the host, so that what does not need a GPU is tested without one. A module of
// its own, built only where the tests run (DPFAST_TEST_HOOKS=1, as `make test` and `make sanitize` do): a release
// dpfast._C carries no test code. The headers it includes are the ones dpfast._C compiles.
#include "python_args.h"

#include "copy_walk.h"
#include "device_routes.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace dpfast {
namespace {

std::vector<c10::Device> devices_of(PyObject* seq, const char* what) {
  const HeldItems items(seq, what);
  std::vector<c10::Device> out;
  for (size_t i = 0; i < items.size(); ++i) {
    TORCH_CHECK_TYPE(THPDevice_Check(items[i]), what, " must hold torch.device objects");
    out.push_back(reinterpret_cast<THPDevice*>(items[i])->device);
  }
  return out;
}

PyObject* device_list(at::ArrayRef<c10::Device> devices) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(devices.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < devices.size(); ++i) {
    PyObject* d = THPDevice_New(devices[i]);
    if (d == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), d);
  }
  return list;
}

// _side_stream_devices(devices, source, current_index) -> list[torch.device]: the GPUs scatter from `source`
// moves chunks to on side streams, after resolving unindexed devices to `current_index`.
PyObject* py_side_stream_devices(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 3 && THPDevice_Check(args[1]), "expected (devices, source, current_index)");
  const auto given = devices_of(args[0], "devices");  // in argument order: current's __index__ may change the list
  const int64_t current = as_int64(args[2], "current_index");
  TORCH_CHECK_VALUE(current >= 0 && current < 128, "current_index ", current, " is out of range");
  const auto devices = resolve_devices(given, static_cast<c10::DeviceIndex>(current));
  return device_list(side_stream_devices(devices, reinterpret_cast<THPDevice*>(args[1])->device));
  END_HANDLE_TH_ERRORS
}

// _node_streams(input_devices, touched) -> (own device or None, [other GPUs to bridge])
PyObject* py_node_streams(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 2, "expected (input_devices, touched)");
  const NodeStreams s = node_streams(devices_of(args[0], "input_devices"), devices_of(args[1], "touched"));
  PyObject* own = s.own ? THPDevice_New(*s.own) : (Py_INCREF(Py_None), Py_None);
  if (own == nullptr) return nullptr;
  PyObject* others = device_list(s.others);
  if (others == nullptr) {
    Py_DECREF(own);
    return nullptr;
  }
  PyObject* out = PyTuple_Pack(2, own, others);
  Py_DECREF(own);
  Py_DECREF(others);
  return out;
  END_HANDLE_TH_ERRORS
}

// _job_offsets(sizes, src_strides, dst_strides, units) -> [(src_off, dst_off)]: the kernel's offsets of the given
// units of a job with this geometry (sizes in units, outermost first; strides in bytes), in the index math the
// kernel picks for it. Touches no memory, so jobs past 2^32 units cost nothing.
PyObject* py_job_offsets(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 4, "expected (sizes, src_strides, dst_strides, units)");
  const HeldItems lists[] = {
      {args[0], "sizes"}, {args[1], "src_strides"}, {args[2], "dst_strides"}, {args[3], "units"}};
  const auto sizes = int_list(lists[0], "sizes"), ss = int_list(lists[1], "src_strides");
  const auto ds = int_list(lists[2], "dst_strides"), units = int_list(lists[3], "units");
  TORCH_CHECK_VALUE(!sizes.empty() && sizes.size() <= static_cast<size_t>(kMaxCopyDims) &&
                        ss.size() == sizes.size() && ds.size() == sizes.size(),
                    "expected 1 to ", kMaxCopyDims, " sizes and as many strides of each side");
  CopyJob job{};
  job.ndim = static_cast<int32_t>(sizes.size());
  job.unit = 1;
  job.numel = 1;
  for (size_t k = 0; k < sizes.size(); ++k) {
    TORCH_CHECK_VALUE(sizes[k] > 0, "sizes must be positive");
    TORCH_CHECK_VALUE(!c10::mul_overflows(job.numel, sizes[k], &job.numel), "the sizes overflow 64 bits");
    job.sizes[k] = sizes[k];
    job.src_strides[k] = ss[k];
    job.dst_strides[k] = ds[k];
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(units.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < units.size(); ++i) {
    if (units[i] < 0 || units[i] >= job.numel) {
      Py_DECREF(list);
      TORCH_CHECK_INDEX(false, "unit ", units[i], " is outside the job's ", job.numel, " units");
    }
    int64_t s = 0, d = 0;
    switch (index_math(job)) {
      case IndexMath::kFlat: unit_offsets<IndexMath::kFlat>(job, units[i], s, d); break;
      case IndexMath::k32: unit_offsets<IndexMath::k32>(job, units[i], s, d); break;
      default: unit_offsets<IndexMath::k64>(job, units[i], s, d); break;
    }
    PyObject* pair = Py_BuildValue("(LL)", static_cast<long long>(s), static_cast<long long>(d));
    if (pair == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), pair);
  }
  return list;
  END_HANDLE_TH_ERRORS
}

// Moves units on the host as the kernel's DeviceMover does on the GPU, refusing any byte outside the storages.
struct HostMover {
  const CopyJob& job;
  uintptr_t src_lo, src_hi, dst_lo, dst_hi;  // the storages' byte ranges
  int64_t moved = 0;

  // [base + off, base + off + unit) within [lo, hi), in integers: no pointer is formed outside the storage
  bool inside(const void* base, int64_t off, uintptr_t lo, uintptr_t hi) const {
    const auto b = reinterpret_cast<uintptr_t>(base);
    if (b < lo || b > hi) return false;
    if (off < 0 ? static_cast<uintptr_t>(-off) > b - lo : static_cast<uintptr_t>(off) > hi - b) return false;
    const uintptr_t at = off < 0 ? b - static_cast<uintptr_t>(-off) : b + static_cast<uintptr_t>(off);
    return at >= lo && hi - at >= static_cast<uintptr_t>(job.unit);
  }

  template <int N>
  void move(const int64_t (&s)[N], const int64_t (&d)[N]) {
    for (int i = 0; i < N; ++i) {
      TORCH_CHECK(inside(job.src, s[i], src_lo, src_hi) && inside(job.dst, d[i], dst_lo, dst_hi),
                  "replayed copy left its tensors' storage (source offset ", s[i], ", destination offset ", d[i], ")");
      std::memcpy(job.dst + d[i], job.src + s[i], static_cast<size_t>(job.unit));
    }
    moved += N;
  }
};

// _replay_cuda_copy(srcs, dsts, blocks, threads) -> (units moved, units planned, jobs, fallback pairs): plans the
// copy of each CPU tensor of srcs into the same-shaped one of dsts exactly as the ops do, then runs every thread
// of a (blocks x threads) grid of the CUDA kernel's walk on the host.
PyObject* py_replay_cuda_copy(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 4, "expected (srcs, dsts, blocks, threads)");
  const HeldItems srcs(args[0], "srcs"), dsts(args[1], "dsts");  // the grid sizes' __index__ may empty the lists
  TORCH_CHECK_VALUE(srcs.size() == dsts.size(), "srcs and dsts differ in length");
  const int64_t blocks = as_int64(args[2], "blocks"), threads = as_int64(args[3], "threads");
  TORCH_CHECK_VALUE(blocks > 0 && threads > 0 && blocks <= (1 << 20) && threads <= 1024, "bad grid ", blocks, " x ",
                    threads);
  const int64_t stride = blocks * threads;
  int64_t moved = 0, planned = 0, n_jobs = 0, n_fallback = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    TORCH_CHECK_TYPE(is_tensor(srcs[i]) && is_tensor(dsts[i]), "srcs and dsts must hold tensors");
    const at::Tensor src = THPVariable_Unpack(srcs[i]), dst = THPVariable_Unpack(dsts[i]);
    TORCH_CHECK_VALUE(src.is_cpu() && dst.is_cpu() && src.sizes() == dst.sizes() && src.dtype() == dst.dtype(),
                      "pair ", i, ": expected CPU tensors of one shape and dtype");
    CopyBatch batch;
    batch.add(src.const_data_ptr(), dst.data_ptr(), src.sizes(), src.strides(), dst.strides(), src.element_size(),
              src, dst);
    for (const auto& [s, d] : batch.fallback) d.copy_(s);
    n_fallback += static_cast<int64_t>(batch.fallback.size());
    const auto src_lo = reinterpret_cast<uintptr_t>(src.storage().data());
    const auto dst_lo = reinterpret_cast<uintptr_t>(dst.storage().mutable_data());
    for (const CopyJob& job : batch.jobs) {
      HostMover mover{job, src_lo, src_lo + src.storage().nbytes(), dst_lo, dst_lo + dst.storage().nbytes()};
      for (int64_t t = 0; t < stride; ++t) walk_job(job, t, stride, mover);
      moved += mover.moved;
      planned += job.numel;
      ++n_jobs;
    }
  }
  return Py_BuildValue("(LLLL)", moved, planned, n_jobs, n_fallback);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_side_stream_devices", DPFAST_FASTCALL(py_side_stream_devices), "tests only: scatter's side-stream GPUs"},
    {"_node_streams", DPFAST_FASTCALL(py_node_streams), "tests only: a backward node's own and bridged devices"},
    {"_job_offsets", DPFAST_FASTCALL(py_job_offsets), "tests only: the CUDA kernel's offsets of some units"},
    {"_replay_cuda_copy", DPFAST_FASTCALL(py_replay_cuda_copy), "tests only: the CUDA kernel's walk, on the host"},
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace
}  // namespace dpfast

// `import dpfast._C_hooks` after `import torch` (which loads the libraries it links against).
PyMODINIT_FUNC PyInit__C_hooks(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_hooks", "dpfast's C++ test hooks", -1,
                                          dpfast::methods};
  return PyModule_Create(&module_def);
}
