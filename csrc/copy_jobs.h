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
    int64_t n = 1;
    bool overflow = false;
    for (int64_t s : shape) overflow |= c10::mul_overflows(n, s, &n);
    int64_t n_bytes = 0;
    overflow |= c10::mul_overflows(n, es, &n_bytes) || dpfast::add_overflows(bytes, n_bytes, &bytes);
    TORCH_CHECK(!overflow, "dpfast: a copy of ", shape.size(), "-dim shape overflows a 64-bit byte count");

    // Dims of size 1 carry no information; then merge each dim into its inner neighbour when both sides
    // are laid out contiguously across the pair, innermost first.
    int64_t sz[64], ss[64], ds[64];
    int nd = 0;
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      const int64_t size = shape[d];
      if (size == 1) continue;
      const int64_t s_st = src_stride[d] * es, d_st = dst_stride[d] * es;
      if (nd > 0 && s_st == ss[nd - 1] * sz[nd - 1] && d_st == ds[nd - 1] * sz[nd - 1]) {
        sz[nd - 1] *= size;  // merged dim keeps the inner stride
        continue;
      }
      sz[nd] = size;
      ss[nd] = s_st;
      ds[nd] = d_st;
      ++nd;
    }
    if (nd == 0) {  // a single element
      sz[0] = 1;
      ss[0] = es;
      ds[0] = es;
      nd = 1;
    }
    if (nd > kMaxCopyDims) {
      const int64_t es_base = static_cast<int64_t>(src_base.element_size());
      auto offset = [&](const at::Tensor& base, const void* p) {
        return base.storage_offset() +
               (static_cast<const char*>(p) - static_cast<const char*>(base.const_data_ptr())) / es_base;
      };
      fallback.emplace_back(src_base.as_strided(shape, src_stride, offset(src_base, src_ptr)),
                            dst_base.as_strided(shape, dst_stride, offset(dst_base, dst_ptr)));
      return;
    }

    // Widen the unit when the innermost run is contiguous on both sides and everything is aligned to it.
    const auto sp = reinterpret_cast<uintptr_t>(src_ptr);
    const auto dp = reinterpret_cast<uintptr_t>(dst_ptr);
    int64_t unit = es;
    if (ss[0] == es && ds[0] == es) {
      for (int64_t w = 16; w > es; w /= 2) {
        bool ok = (sz[0] * es) % w == 0 && sp % w == 0 && dp % w == 0;
        for (int k = 1; ok && k < nd; ++k) ok = ss[k] % w == 0 && ds[k] % w == 0;
        if (ok) {
          unit = w;
          break;
        }
      }
      if (unit != es) {
        sz[0] = sz[0] * es / unit;
        ss[0] = unit;
        ds[0] = unit;
      }
    }

    CopyJob job{};
    job.src = reinterpret_cast<const char*>(sp);
    job.dst = reinterpret_cast<char*>(dp);
    job.ndim = nd;
    job.unit = static_cast<int32_t>(unit);
    job.numel = 1;
    for (int k = 0; k < nd; ++k) {  // sz/ss/ds are innermost-first; jobs are outermost-first
      job.sizes[nd - 1 - k] = sz[k];
      job.src_strides[nd - 1 - k] = ss[k];
      job.dst_strides[nd - 1 - k] = ds[k];
      job.numel *= sz[k];
    }
    jobs.push_back(job);
  }
};

}  // namespace dpfast
#endif
