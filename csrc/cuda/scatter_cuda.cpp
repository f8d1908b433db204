// Host side of scatter on CUDA: pack every chunk on the source in one launch, then move the chunks bound for
// other GPUs on side streams, one per destination, so the copies to different GPUs overlap (a plain
// Tensor::to would run them one after another on the source's current stream). The host never waits.
#include "../device_routes.h"
#include "../scatter.h"
#include "copy_cuda.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <memory>

namespace dpfast {
namespace {

// Ordering, per destination GPU: the side stream waits for the pack (an event on the source's current stream);
// Tensor::copy_ then makes it wait for the destination's current stream (the fresh block may be reused from
// earlier work there) and makes that stream wait for the copy. The packed block is recorded on the side stream,
// so the caching allocator does not hand it out again while the copy still reads it.
// (A raw cudaEvent_t: ATen's CUDAEvent header pulls in cuSPARSE headers that a bare toolkit may lack.)
void move_on_side_streams(std::vector<at::Tensor>& packed, at::ArrayRef<c10::Device> devices, c10::Device source,
                          const DeviceList& targets) {
  const size_t k = devices.size();
  cudaEvent_t packed_ready;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&packed_ready, cudaEventDisableTiming));
  // destroyed on every exit; CUDA keeps a recorded event alive until the work it marks is done
  const std::unique_ptr<CUevent_st, void (*)(cudaEvent_t)> owner(packed_ready,
                                                                 [](cudaEvent_t e) { cudaEventDestroy(e); });
  C10_CUDA_CHECK(cudaEventRecord(packed_ready, c10::cuda::getCurrentCUDAStream(source.index())));
  for (const c10::Device& dst : targets) {  // chunks for the same GPU share its side stream
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, source.index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(side, packed_ready, 0));
    const c10::cuda::CUDAStreamGuard on_side(side);  // copy_ runs on the source device's current stream
    for (size_t idx = 0; idx < packed.size(); ++idx) {
      if (devices[idx % k] != dst) continue;
      at::Tensor moved = at::empty(packed[idx].sizes(), packed[idx].options().device(dst));
      moved.copy_(packed[idx], /*non_blocking=*/true);
      if (packed[idx].numel() > 0) {
        c10::cuda::CUDACachingAllocator::recordStream(packed[idx].storage().data_ptr(), side);
      }
      packed[idx] = std::move(moved);
    }
  }
}

}  // namespace

std::vector<at::Tensor> scatter_cuda(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes,
                                     at::ArrayRef<c10::Device> requested) {
  scatter_check(sizes, requested);
  check_same_device("scatter", xs);
  // before the guard below changes it: "cuda" is the caller's current device
  const std::vector<c10::Device> devices = resolve_devices(requested, c10::cuda::current_device());
  const c10::Device source = xs[0].device();
  const c10::cuda::CUDAGuard guard(source);
  CopyBatch batch;
  auto outs = split_jobs("scatter", xs, dim, sizes, batch);
  run_copies_cuda(batch);
  const DeviceList targets = side_stream_devices(devices, source);
  if (!targets.empty()) {
    // Under graph capture, forking onto pool streams would need the destinations' streams captured too: keep
    // the current-stream copies there.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(source.index()), &capture));
    if (capture == cudaStreamCaptureStatusNone) move_on_side_streams(outs, devices, source, targets);
  }
  scatter_move(outs, devices);  // what is left: chunks for the CPU (blocking) and, under capture, other GPUs
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CUDA, m) { m.impl("scatter", &scatter_cuda); }

}  // namespace dpfast
