// The one CUDA kernel: every job of a batch (all tensors, all chunks) in a single launch. Each thread walks the
// jobs in order and grid-strides over each job's units (copy_walk.h), kUnroll units in flight at a time, so loads
// and stores of neighbouring threads are neighbouring 16-byte units whenever the innermost run allows it. Up to
// kInlineJobs jobs travel in the kernel's parameter space (no extra copy); more are staged in device memory by one
// async copy from pinned memory.
#include "../copy_walk.h"
#include "copy_cuda.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
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
// Launches of few jobs (an LSTM's h and c, a handful of chunks) pass a small parameter block; the rest the
// largest that fits the 4 KB every GPU accepts.
constexpr int kFewJobs = 4;
constexpr int kInlineJobs = static_cast<int>((4096 - sizeof(int64_t)) / sizeof(CopyJob));

template <int N>
struct InlineJobs {
  CopyJob jobs[N];
};
static_assert(kInlineJobs >= 16, "at least 16 jobs travel as kernel parameters");
static_assert(sizeof(InlineJobs<kInlineJobs>) + sizeof(int) <= 4096, "kernel parameters must fit in 4 KB");

// Moves whole units of type V (1 to 16 bytes) between the job's buffers: all loads of a group, then its stores.
template <class V>
struct DeviceMover {
  const char* __restrict__ src;
  char* __restrict__ dst;

  template <int N>
  __device__ __forceinline__ void move(const int64_t (&s)[N], const int64_t (&d)[N]) {
    V v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = *reinterpret_cast<const V*>(src + s[i]);
#pragma unroll
    for (int i = 0; i < N; ++i) *reinterpret_cast<V*>(dst + d[i]) = v[i];
  }
};

template <class V>
__device__ __forceinline__ void run_job_as(const CopyJob& job, int64_t first, int64_t stride) {
  DeviceMover<V> mover{job.src, job.dst};
  walk_job(job, first, stride, mover);
}

__device__ __forceinline__ void run_jobs(const CopyJob* jobs, int n_jobs) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int k = 0; k < n_jobs; ++k) {
    const CopyJob& job = jobs[k];
    if (first >= job.numel) continue;
    switch (job.unit) {
      case 16: run_job_as<uint4>(job, first, stride); break;
      case 8: run_job_as<uint2>(job, first, stride); break;
      case 4: run_job_as<uint32_t>(job, first, stride); break;
      case 2: run_job_as<uint16_t>(job, first, stride); break;
      default: run_job_as<uint8_t>(job, first, stride); break;
    }
  }
}

template <int N>
__global__ void __launch_bounds__(kThreads) copy_inline_kernel(const DPFAST_GRID_CONSTANT InlineJobs<N> batch, int n) {
  run_jobs(batch.jobs, n);
}

__global__ void __launch_bounds__(kThreads) copy_global_kernel(const CopyJob* __restrict__ jobs, int n) {
  run_jobs(jobs, n);
}

// The most blocks of `kernel` that run at once on a device (SMs times the blocks that fit on one): a bigger grid
// only queues, a smaller one leaves SMs idle. Cached per device and kernel; threads racing on a first call compute
// the same value and store it atomically.
template <auto Kernel>
int resident_blocks(int device) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  TORCH_CHECK(device >= 0 && device < C10_COMPILE_TIME_MAX_GPUS, "dpfast: CUDA device index ", device,
              " is out of range");
  int blocks = cache[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0));
    blocks = std::max(1, sms) * std::max(1, per_sm);
    cache[device].store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

// One thread per unit of the widest job, up to what runs at once.
template <auto Kernel>
int grid_for(int device, int64_t widest) {
  const int64_t want = (widest + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, resident_blocks<Kernel>(device))));
}

template <int N>
void launch_inline(const CopyJob* jobs, int count, int device, int64_t widest, cudaStream_t stream) {
  InlineJobs<N> params;
  std::memcpy(params.jobs, jobs, static_cast<size_t>(count) * sizeof(CopyJob));
  const int blocks = grid_for<copy_inline_kernel<N>>(device, widest);
  copy_inline_kernel<N><<<blocks, kThreads, 0, stream>>>(params, count);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void run_copies_cuda(const CopyBatch& batch) {
  const auto& jobs = batch.jobs;
  if (!jobs.empty()) {
    TORCH_CHECK(jobs.size() <= static_cast<size_t>(INT32_MAX), "dpfast: ", jobs.size(), " copy jobs in one launch");
    int64_t widest = 1;
    for (const CopyJob& j : jobs) widest = std::max(widest, j.numel);
    const int device = c10::cuda::current_device();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    const int n = static_cast<int>(jobs.size());
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (n > kInlineJobs) C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (n <= kFewJobs) {
      launch_inline<kFewJobs>(jobs.data(), n, device, widest, stream);
    } else if (n <= kInlineJobs || capture != cudaStreamCaptureStatusNone) {
      // Jobs travel as kernel parameters. Under CUDA graph capture that holds for any count, in launches of
      // kInlineJobs: a graph replays the staging copy's read of the pinned buffer long after it was freed and
      // handed out again, while parameters are baked into the graph.
      for (int first = 0; first < n; first += kInlineJobs) {
        launch_inline<kInlineJobs>(jobs.data() + first, std::min(kInlineJobs, n - first), device, widest, stream);
      }
    } else {
      // Staged through pinned memory: torch's non-blocking copy_ records the pinned block's use on this stream,
      // so the host allocator does not hand it out again before the copy has run, and the host never waits.
      const int64_t bytes = static_cast<int64_t>(jobs.size() * sizeof(CopyJob));
      at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      std::memcpy(host.data_ptr(), jobs.data(), static_cast<size_t>(bytes));
      at::Tensor staged = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device));
      staged.copy_(host, /*non_blocking=*/true);
      const int blocks = grid_for<copy_global_kernel>(device, widest);
      copy_global_kernel<<<blocks, kThreads, 0, stream>>>(reinterpret_cast<const CopyJob*>(staged.data_ptr()), n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  for (const auto& [src, dst] : batch.fallback) dst.copy_(src);
}

}  // namespace dpfast
