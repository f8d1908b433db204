// split_contiguous: chunk j of xs[i] along dim, contiguous; out is flat and tensor-major (i * n_chunks + j).
#pragma once

#include "checks.h"
#include "copy_plan.h"

#include <ATen/ops/empty.h>

namespace dpfast {

// Allocates every chunk on `xs`' device and queues its copy.
inline std::vector<at::Tensor> split_plan(const char* op, at::TensorList xs, int64_t dim,
                                          c10::SymIntArrayRef sym_sizes, CopyBatch& batch) {
  std::vector<int64_t> sizes;
  check_split(op, xs, dim, sym_sizes, sizes);
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
    for (int64_t s : sizes) {
      shape[d] = s;
      at::Tensor out = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
      batch.add(base + offset * step, out.data_ptr(), shape, x.strides(), out.strides(), x.element_size(), x, out);
      outs.push_back(std::move(out));
      offset += s;
    }
  }
  return outs;
}

}  // namespace dpfast
