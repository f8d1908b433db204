// gather: concatenate chunks along dim on one device (the inverse of scatter).
#pragma once

#include "checks.h"
#include "copy_jobs.h"

#include <ATen/ops/empty.h>

namespace dpfast {

// Validates the chunks and returns the wrapped dim and the output shape.
inline int64_t gather_check(at::TensorList chunks, int64_t dim, std::vector<int64_t>& out_shape) {
  constexpr const char* op = "gather";
  TORCH_CHECK_VALUE(!chunks.empty(), op, ": chunks is empty; give at least one tensor to concatenate");
  check_defined(op, "chunks", chunks);
  const at::Tensor& ref = chunks[0];
  const int64_t d = wrap_dim(op, "chunks", 0, ref, dim);
  out_shape = ref.sizes().vec();
  out_shape[d] = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const at::Tensor& c = chunks[i];
    wrap_dim(op, "chunks", i, c, dim);
    bool same = c.dim() == ref.dim() && c.scalar_type() == ref.scalar_type();
    for (int64_t k = 0; same && k < c.dim(); ++k) same = k == d || c.size(k) == ref.size(k);
    TORCH_CHECK_VALUE(same, op, ": chunks[", i, "] has shape ", shape_str(c.sizes()), " and dtype ",
                      dtype_str(c.scalar_type()), " but chunks[0] has ", shape_str(ref.sizes()), " and ",
                      dtype_str(ref.scalar_type()),
                      "; chunks must agree in dtype and in every dim except ", dim);
    TORCH_CHECK_VALUE(!dpfast::add_overflows(out_shape[d], c.size(d), &out_shape[d]), op,
                      ": the chunks' sizes along dim ", dim, " sum past 2**63 - 1");
  }
  checked_nbytes(op, "the output", out_shape, static_cast<int64_t>(ref.element_size()));
  return d;
}

// Queues the copy of each (already local) chunk into its slice of `out`.
inline void gather_jobs(at::TensorList local_chunks, int64_t d, const at::Tensor& out, CopyBatch& batch) {
  char* base = static_cast<char*>(out.data_ptr());
  const int64_t step = out.stride(d) * static_cast<int64_t>(out.element_size());
  int64_t offset = 0;
  batch.jobs.reserve(local_chunks.size());
  for (const at::Tensor& c : local_chunks) {
    // gather_check sized `out` from these chunks; a chunk that does not fit its slice must never be copied
    TORCH_CHECK(c.dim() == out.dim() && c.size(d) <= out.size(d) - offset, "gather: chunk of shape ",
                shape_str(c.sizes()), " does not fit the output ", shape_str(out.sizes()), " at offset ", offset);
    for (int64_t k = 0; k < c.dim(); ++k) {
      TORCH_CHECK(k == d || c.size(k) == out.size(k), "gather: chunk of shape ", shape_str(c.sizes()),
                  " does not match the output ", shape_str(out.sizes()));
    }
    // the slice out.narrow(d, offset, size) without building the view
    batch.add(c.const_data_ptr(), base + offset * step, c.sizes(), c.strides(), out.strides(), c.element_size(), c,
              out);
    offset += c.size(d);
  }
}

}  // namespace dpfast
