// Host side of gather when any chunk is on a GPU: bring foreign chunks to the target device (async
// device-to-device copies; blocking when the target is the CPU, whose kernel reads them at once, or the source is
// the caller's pinned host memory), then join everything in one launch there.
#include "../cpu/copy_cpu.h"
#include "../device_routes.h"
#include "../gather.h"
#include "copy_cuda.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace dpfast {

at::Tensor gather_cuda(at::TensorList chunks, int64_t dim, c10::Device device) {
  std::vector<int64_t> shape;
  const int64_t d = gather_check(chunks, dim, shape);
  const c10::Device target = resolve_device(device, c10::cuda::current_device());
  const bool to_cpu = !target.is_cuda();
  std::vector<at::Tensor> local;
  local.reserve(chunks.size());
  for (const at::Tensor& c : chunks) {
    if (c.device() == target) {
      local.push_back(c);
      continue;
    }
    // Non-blocking except from pinned host memory: a pageable source is staged before cudaMemcpyAsync returns,
    // but a pinned one is read by the DMA later, so a write to the caller's chunk after we return would race.
    const bool blocking = to_cpu || (c.is_cpu() && c.is_pinned());
    local.push_back(c.to(target, /*non_blocking=*/!blocking));
  }
  at::Tensor out = at::empty(shape, chunks[0].options().device(target));
  CopyBatch batch;
  gather_jobs(local, d, out, batch);
  if (to_cpu) {
    run_copies_cpu(batch);
  } else {
    const c10::cuda::CUDAGuard guard(target);
    run_copies_cuda(batch);
  }
  return out;
}

TORCH_LIBRARY_IMPL(dpfast, CUDA, m) { m.impl("gather", &gather_cuda); }

}  // namespace dpfast
