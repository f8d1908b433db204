// split_contiguous: chunk j of xs[i] along dim, contiguous; out is flat and tensor-major (i * n_chunks + j).
#pragma once

#include "checks.h"
#include "copy_jobs.h"

#include <ATen/ops/empty.h>

namespace dpfast {

// Allocates every chunk on `xs`' device and queues its copy. `destinations` (scatter from the CPU: one device
// per chunk) puts the chunks of a pinned tensor that are bound for a GPU in pinned memory too, so that their copy
// to the GPU stays asynchronous; from pageable memory it would be staged and synchronous.
inline std::vector<at::Tensor> split_jobs(const char* op, at::TensorList xs, int64_t dim,
                                          c10::SymIntArrayRef sym_sizes, CopyBatch& batch,
                                          at::ArrayRef<c10::Device> destinations = {}) {
  std::vector<int64_t> sizes;
  check_split(op, xs, dim, sym_sizes, sizes);
  TORCH_CHECK(destinations.empty() || destinations.size() == sizes.size(), op, ": ", destinations.size(),
              " devices for ", sizes.size(), " chunks");
  bool to_gpu = false;
  for (const c10::Device& d : destinations) to_gpu = to_gpu || d.is_cuda();
  std::vector<at::Tensor> outs;
  outs.reserve(xs.size() * sizes.size());
  batch.jobs.reserve(xs.size() * sizes.size());
  for (const at::Tensor& x : xs) {
    // a negative dim counts from each tensor's own end: (5, 3) and (2, 5, 3) split dim -2 along 0 and 1
    const int64_t d = dim < 0 ? dim + x.dim() : dim;
    // x.narrow(d, offset, s) without building the view: shift the pointer, shrink dim d
    c10::SmallVector<int64_t, 8> shape(x.sizes().begin(), x.sizes().end());
    const char* base = static_cast<const char*>(x.const_data_ptr());
    const int64_t step = x.stride(d) * static_cast<int64_t>(x.element_size());
    int64_t offset = 0;
    const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
    const bool pinned = to_gpu && x.is_cpu() && x.is_pinned();  // asked only when a chunk goes to a GPU
    for (size_t j = 0; j < sizes.size(); ++j) {
      const int64_t s = sizes[j];
      shape[d] = s;
      const bool pin = pinned && destinations[j].is_cuda();
      at::Tensor out = at::empty(shape, pin ? options.pinned_memory(true) : options);
      batch.add(base + offset * step, out.data_ptr(), shape, x.strides(), out.strides(), x.element_size(), x, out);
      outs.push_back(std::move(out));
      offset += s;
    }
  }
  return outs;
}

}  // namespace dpfast
