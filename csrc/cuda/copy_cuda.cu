// The one CUDA kernel: every job of a batch (all tensors, all chunks) in a single launch. Each thread walks
// the jobs in order and grid-strides over each job's units, so loads and stores of neighbouring threads are
// neighbouring 16-byte units whenever the innermost run allows it. Up to kInlineJobs jobs travel in the
// kernel's parameter space (no extra copy); more are staged in device memory by one async copy from pinned memory.
#include "copy_cuda.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

// __grid_constant__ (CUDA >= 11.7) is only allowed when compiling for sm_70 or later; an arch list with an older
// GPU (a Pascal card under a CUDA 11/12 torch) would otherwise fail to build. Without it the kernel still works:
// the parameter is copied to local memory once per thread instead of read in place.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#define DPFAST_GRID_CONSTANT
#else
#define DPFAST_GRID_CONSTANT __grid_constant__
#endif

namespace dpfast {
namespace {

constexpr int kThreads = 256;
constexpr int kInlineJobs = 16;  // 16 * sizeof(CopyJob) stays under the 4 KB kernel-parameter limit
constexpr int kBlocksPerSM = 8;

struct InlineJobs {
  CopyJob jobs[kInlineJobs];
};
static_assert(sizeof(InlineJobs) + sizeof(int) <= 4096, "kernel parameters must fit in 4 KB");

__device__ __forceinline__ void move_unit(const char* s, char* d, int unit) {
  switch (unit) {
    case 16: *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(s); break;
    case 8: *reinterpret_cast<uint2*>(d) = *reinterpret_cast<const uint2*>(s); break;
    case 4: *reinterpret_cast<uint32_t*>(d) = *reinterpret_cast<const uint32_t*>(s); break;
    case 2: *reinterpret_cast<uint16_t*>(d) = *reinterpret_cast<const uint16_t*>(s); break;
    default: *d = *s; break;
  }
}

__device__ __forceinline__ void run_jobs(const CopyJob* jobs, int n_jobs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < n_jobs; ++k) {
    const CopyJob& job = jobs[k];
    if (job.ndim == 1) {  // a flat run (split along dim 0, contiguous chunks): no index math at all
      const int64_t ss = job.src_strides[0], ds = job.dst_strides[0];
      for (int64_t u = first; u < job.numel; u += stride) move_unit(job.src + u * ss, job.dst + u * ds, job.unit);
      continue;
    }
    if (job.numel <= static_cast<int64_t>(UINT32_MAX)) {  // the common case: 32-bit index math
      for (int64_t u = first; u < job.numel; u += stride) {
        int64_t so, dso;
        job_offsets_as<uint32_t>(job, static_cast<uint32_t>(u), so, dso);
        move_unit(job.src + so, job.dst + dso, job.unit);
      }
      continue;
    }
    for (int64_t u = first; u < job.numel; u += stride) {
      int64_t so, dso;
      job_offsets(job, u, so, dso);
      move_unit(job.src + so, job.dst + dso, job.unit);
    }
  }
}

__global__ void __launch_bounds__(kThreads) copy_inline_kernel(const DPFAST_GRID_CONSTANT InlineJobs batch, int n) {
  run_jobs(batch.jobs, n);
}

__global__ void __launch_bounds__(kThreads) copy_global_kernel(const CopyJob* __restrict__ jobs, int n) {
  run_jobs(jobs, n);
}

int sm_count(int device) {
  static int cache[64] = {0};
  if (device < 0 || device >= 64) device = 0;
  if (cache[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = std::max(n, 1);
  }
  return cache[device];
}

}  // namespace

void run_copies_cuda(const CopyBatch& batch) {
  const auto& jobs = batch.jobs;
  if (!jobs.empty()) {
    int64_t widest = 1;
    for (const CopyJob& j : jobs) widest = std::max(widest, j.numel);
    const int device = c10::cuda::current_device();
    const int64_t want = (widest + kThreads - 1) / kThreads;
    const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, sm_count(device) * kBlocksPerSM)));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    const int n = static_cast<int>(jobs.size());
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (n > kInlineJobs) C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (n <= kInlineJobs || capture != cudaStreamCaptureStatusNone) {
      // Jobs travel as kernel parameters. Under CUDA graph capture that holds for any count, in launches of
      // kInlineJobs: a graph replays the staging copy's read of the pinned buffer long after it was freed and
      // handed out again, while parameters are baked into the graph.
      InlineJobs inline_jobs;
      for (int first = 0; first < n; first += kInlineJobs) {
        const int count = std::min(kInlineJobs, n - first);
        std::memcpy(inline_jobs.jobs, jobs.data() + first, count * sizeof(CopyJob));
        copy_inline_kernel<<<blocks, kThreads, 0, stream>>>(inline_jobs, count);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    } else {
      // Staged through pinned memory: torch's non-blocking copy_ records the pinned block's use on this stream,
      // so the host allocator does not hand it out again before the copy has run, and the host never waits.
      const int64_t bytes = static_cast<int64_t>(jobs.size() * sizeof(CopyJob));
      at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      std::memcpy(host.data_ptr(), jobs.data(), static_cast<size_t>(bytes));
      at::Tensor staged = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
      staged.copy_(host, /*non_blocking=*/true);
      copy_global_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const CopyJob*>(staged.data_ptr()), n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  for (const auto& [src, dst] : batch.fallback) dst.copy_(src);
}

}  // namespace dpfast
