// Host side of scatter on CUDA: pack every chunk on the source in one launch, then move each chunk to its
// device with an async device-to-device copy ordered against both devices' current streams (scatter_move).
#include "../scatter.h"
#include "copy_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace dpfast {

std::vector<at::Tensor> scatter_cuda(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes,
                                     at::ArrayRef<c10::Device> devices) {
  scatter_check(sizes, devices);
  check_same_device("scatter", xs);
  const c10::cuda::CUDAGuard guard(xs[0].device());
  CopyBatch batch;
  auto outs = split_plan("scatter", xs, dim, sizes, batch);
  run_copies_cuda(batch);
  scatter_move(outs, devices);
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CUDA, m) { m.impl("scatter", &scatter_cuda); }

}  // namespace dpfast
