// How the CUDA kernel walks a CopyJob: which units each thread moves, in which groups, with which index math.
// Host and device code, so that the host can replay the kernel's exact walk (testing/python_hooks.cpp) and the tests
// can check, without a GPU, that every unit is moved exactly once to the right place.
#pragma once

#include "copy_jobs.h"

namespace dpfast {

// Units a thread has in flight: it computes the offsets and issues the loads of a group before its stores.
constexpr int kUnroll = 4;

enum class IndexMath : int {
  kFlat,  // one dim (a split along dim 0, contiguous chunks): no division at all
  k32,    // fewer than 2^32 units: 32-bit divisions, several times cheaper than 64-bit ones
  k64,
};

DPFAST_HD IndexMath index_math(const CopyJob& job) {
  if (job.ndim == 1) return IndexMath::kFlat;
  return job.numel <= static_cast<int64_t>(UINT32_MAX) ? IndexMath::k32 : IndexMath::k64;
}

template <IndexMath M>
DPFAST_HD void unit_offsets(const CopyJob& job, int64_t u, int64_t& src_off, int64_t& dst_off) {
  if constexpr (M == IndexMath::kFlat) {
    src_off = u * job.src_strides[0];
    dst_off = u * job.dst_strides[0];
  } else if constexpr (M == IndexMath::k32) {
    job_offsets_as<uint32_t>(job, static_cast<uint32_t>(u), src_off, dst_off);
  } else {
    job_offsets(job, u, src_off, dst_off);
  }
}

// Thread `first` of `stride` threads moves units first, first + stride, first + 2 * stride, ... of the job, so
// neighbouring threads move neighbouring units (coalesced). Full groups of kUnroll go to `mover.move<kUnroll>`,
// the rest one unit at a time to `mover.move<1>`, each with the units' source and destination byte offsets.
#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <IndexMath M, class Mover>
DPFAST_HD void walk_job(const CopyJob& job, int64_t first, int64_t stride, Mover& mover) {
  const int64_t n = job.numel;
  int64_t u = first;
  for (; u + (kUnroll - 1) * stride < n; u += kUnroll * stride) {
    int64_t s[kUnroll], d[kUnroll];
#ifdef __CUDACC__
#pragma unroll
#endif
    for (int i = 0; i < kUnroll; ++i) unit_offsets<M>(job, u + i * stride, s[i], d[i]);
    mover.template move<kUnroll>(s, d);
  }
  for (; u < n; u += stride) {
    int64_t s[1], d[1];
    unit_offsets<M>(job, u, s[0], d[0]);
    mover.template move<1>(s, d);
  }
}

#ifdef __CUDACC__
#pragma nv_exec_check_disable
#endif
template <class Mover>
DPFAST_HD void walk_job(const CopyJob& job, int64_t first, int64_t stride, Mover& mover) {
  switch (index_math(job)) {
    case IndexMath::kFlat: walk_job<IndexMath::kFlat>(job, first, stride, mover); break;
    case IndexMath::k32: walk_job<IndexMath::k32>(job, first, stride, mover); break;
    default: walk_job<IndexMath::k64>(job, first, stride, mover); break;
  }
}

}  // namespace dpfast
