// Batched strided byte copies: the single primitive behind every dpfast op.
//
// transpose01, split_contiguous, scatter (pack) and gather (unpack) are all "copy these N (src view, dst view)
// pairs", so each op only builds views and one executor per device moves the bytes in one pass (one CUDA launch).
// Copies are typeless: elements are moved as 1/2/4/8/16-byte units, widened to 16 bytes where the innermost
// run and every address and stride allow it, which makes every dtype (bool, complex, ...) work bit-exactly.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DPFAST_HD __host__ __device__ __forceinline__
#else
#define DPFAST_HD inline
#endif

namespace dpfast {

constexpr int kMaxCopyDims = 6;  // dims left after coalescing; more falls back to Tensor::copy_

struct CopyJob {
  const char* src;
  char* dst;
  int64_t numel;                      // units to move
  int64_t sizes[kMaxCopyDims];        // outermost first; sizes[ndim - 1] is the innermost, in units
  int64_t src_strides[kMaxCopyDims];  // bytes
  int64_t dst_strides[kMaxCopyDims];  // bytes
  int32_t ndim;
  int32_t unit;  // bytes per unit: 1, 2, 4, 8 or 16
};

// Byte offsets of unit `u` (row-major over job.sizes) in the source and the destination. `Index` is the type the
// division runs in: the CUDA kernel uses uint32_t whenever the job has fewer than 2^32 units, since a 64-bit
// division costs several times as many instructions as a 32-bit one and runs once per dim per unit.
template <class Index>
DPFAST_HD void job_offsets_as(const CopyJob& job, Index u, int64_t& src_off, int64_t& dst_off) {
  int64_t s = 0, d = 0;
  for (int k = job.ndim - 1; k > 0; --k) {
    const Index size = static_cast<Index>(job.sizes[k]);
    const Index q = u / size;
    const int64_t i = static_cast<int64_t>(u - q * size);
    u = q;
    s += i * job.src_strides[k];
    d += i * job.dst_strides[k];
  }
  src_off = s + static_cast<int64_t>(u) * job.src_strides[0];
  dst_off = d + static_cast<int64_t>(u) * job.dst_strides[0];
}

DPFAST_HD void job_offsets(const CopyJob& job, int64_t u, int64_t& src_off, int64_t& dst_off) {
  job_offsets_as<int64_t>(job, u, src_off, dst_off);
}

}  // namespace dpfast

#if !defined(__CUDACC_RTC__)
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include "overflow.h"

#include <utility>
#include <vector>

namespace dpfast {

// A copy's geometry once size-1 dims are dropped and contiguous neighbours merged: innermost dim first, strides in
// bytes on both sides. (At most 64 dims: a tensor has no more.)
struct CoalescedDims {
  int64_t size[64], src_stride[64], dst_stride[64];
  int ndim = 0;
};

// Merges each dim into its inner neighbour when both sides are laid out contiguously across the pair.
inline CoalescedDims coalesce(c10::IntArrayRef shape, c10::IntArrayRef src_stride, c10::IntArrayRef dst_stride,
                              int64_t element_size) {
  CoalescedDims c;
  int& nd = c.ndim;
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    const int64_t size = shape[d];
    if (size == 1) continue;  // carries no information
    const int64_t s_st = src_stride[d] * element_size, d_st = dst_stride[d] * element_size;
    if (nd > 0 && s_st == c.src_stride[nd - 1] * c.size[nd - 1] && d_st == c.dst_stride[nd - 1] * c.size[nd - 1]) {
      c.size[nd - 1] *= size;  // the merged dim keeps the inner stride
      continue;
    }
    c.size[nd] = size;
    c.src_stride[nd] = s_st;
    c.dst_stride[nd] = d_st;
    ++nd;
  }
  if (nd == 0) {  // a single element
    c.size[0] = 1;
    c.src_stride[0] = c.dst_stride[0] = element_size;
    nd = 1;
  }
  return c;
}

// The widest unit (16, 8, ... bytes, down to the element) that the innermost run, both addresses and every stride
// allow, when the innermost run is contiguous on both sides; the innermost dim is then counted in those units.
inline int64_t widen_unit(CoalescedDims& c, uintptr_t src, uintptr_t dst, int64_t element_size) {
  if (c.src_stride[0] != element_size || c.dst_stride[0] != element_size) return element_size;
  for (int64_t w = 16; w > element_size; w /= 2) {
    bool ok = (c.size[0] * element_size) % w == 0 && src % w == 0 && dst % w == 0;
    for (int k = 1; ok && k < c.ndim; ++k) ok = c.src_stride[k] % w == 0 && c.dst_stride[k] % w == 0;
    if (ok) {
      c.size[0] = c.size[0] * element_size / w;
      c.src_stride[0] = c.dst_stride[0] = w;
      return w;
    }
  }
  return element_size;
}

// What one launch moves: jobs for the executor, plus (rarely) pairs with too many non-mergeable dims.
struct CopyBatch {
  std::vector<CopyJob> jobs;
  std::vector<std::pair<at::Tensor, at::Tensor>> fallback;  // (src, dst), copied with Tensor::copy_
  int64_t bytes = 0;

  // Queue the copy of `shape` elements from `src_ptr` to `dst_ptr` (strides in elements, same dtype and device).
  // Ops pass raw geometry rather than a view tensor per chunk (a view costs an allocation per call); `src_base`
  // and `dst_base` are the tensors the pointers lie in, used only to build views for the rare fallback copy.
  void add(const void* src_ptr, void* dst_ptr, c10::IntArrayRef shape, c10::IntArrayRef src_stride,
           c10::IntArrayRef dst_stride, size_t element_size, const at::Tensor& src_base, const at::Tensor& dst_base) {
    for (int64_t s : shape) {
      if (s == 0) return;  // before multiplying: a zero anywhere makes the product of the others irrelevant
    }
    const int64_t es = static_cast<int64_t>(element_size);
    count_bytes(shape, es);
    CoalescedDims dims = coalesce(shape, src_stride, dst_stride, es);
    if (dims.ndim > kMaxCopyDims) {
      fallback.emplace_back(view(src_base, src_ptr, shape, src_stride), view(dst_base, dst_ptr, shape, dst_stride));
      return;
    }
    const auto sp = reinterpret_cast<uintptr_t>(src_ptr), dp = reinterpret_cast<uintptr_t>(dst_ptr);
    const int64_t unit = widen_unit(dims, sp, dp, es);
    CopyJob job{};
    job.src = reinterpret_cast<const char*>(sp);
    job.dst = reinterpret_cast<char*>(dp);
    job.ndim = dims.ndim;
    job.unit = static_cast<int32_t>(unit);
    job.numel = 1;
    for (int k = 0; k < dims.ndim; ++k) {  // dims are innermost-first; jobs are outermost-first
      job.sizes[dims.ndim - 1 - k] = dims.size[k];
      job.src_strides[dims.ndim - 1 - k] = dims.src_stride[k];
      job.dst_strides[dims.ndim - 1 - k] = dims.dst_stride[k];
      job.numel *= dims.size[k];
    }
    jobs.push_back(job);
  }

 private:
  // Adds the copy's size to `bytes`; a count past 64 bits (zero-stride views make that cheap) is an error.
  void count_bytes(c10::IntArrayRef shape, int64_t element_size) {
    int64_t n = 1, n_bytes = 0;
    bool overflow = false;
    for (int64_t s : shape) overflow |= c10::mul_overflows(n, s, &n);
    overflow |= c10::mul_overflows(n, element_size, &n_bytes) || dpfast::add_overflows(bytes, n_bytes, &bytes);
    TORCH_CHECK(!overflow, "dpfast: a copy of ", shape.size(), "-dim shape overflows a 64-bit byte count");
  }

  // The view of `base` that `ptr` and this geometry describe, for Tensor::copy_.
  static at::Tensor view(const at::Tensor& base, const void* ptr, c10::IntArrayRef shape, c10::IntArrayRef stride) {
    const auto from = static_cast<const char*>(base.const_data_ptr());
    const int64_t offset = (static_cast<const char*>(ptr) - from) / static_cast<int64_t>(base.element_size());
    return base.as_strided(shape, stride, base.storage_offset() + offset);
  }
};

}  // namespace dpfast
#endif
