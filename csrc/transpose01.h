// transpose01: out[i] = xs[i].transpose(0, 1).contiguous(), every tensor in one batch of copies.
#pragma once

#include "checks.h"
#include "copy_jobs.h"

#include <ATen/ops/empty.h>

namespace dpfast {

inline std::vector<at::Tensor> transpose01_jobs(at::TensorList xs, CopyBatch& batch) {
  constexpr const char* op = "transpose01";
  check_defined(op, "tensors", xs);
  check_same_device(op, xs);
  std::vector<at::Tensor> outs;
  outs.reserve(xs.size());
  batch.jobs.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    TORCH_CHECK_VALUE(x.dim() >= 2, op, ": tensors[", i, "] has shape ", shape_str(x.sizes()), " (", x.dim(),
                      " dims); every tensor needs at least 2 dims to swap dims 0 and 1");
    // x.transpose(0, 1) without building the view: swap the first two sizes and strides
    c10::SmallVector<int64_t, 8> shape(x.sizes().begin(), x.sizes().end());
    c10::SmallVector<int64_t, 8> stride(x.strides().begin(), x.strides().end());
    std::swap(shape[0], shape[1]);
    std::swap(stride[0], stride[1]);
    at::Tensor out = at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
    batch.add(x.const_data_ptr(), out.data_ptr(), shape, stride, out.strides(), x.element_size(), x, out);
    outs.push_back(std::move(out));
  }
  return outs;
}

}  // namespace dpfast
