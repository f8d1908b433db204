// Host side of transpose01 on CUDA (the kernel is the shared one in copy_cuda.cu).
#include "../transpose01.h"
#include "copy_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace dpfast {

std::vector<at::Tensor> transpose01_cuda(at::TensorList xs) {
  check_same_device("transpose01", xs);
  const c10::cuda::CUDAGuard guard(xs[0].device());
  CopyBatch batch;
  auto outs = transpose01_jobs(xs, batch);
  run_copies_cuda(batch);
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CUDA, m) { m.impl("transpose01", &transpose01_cuda); }

}  // namespace dpfast
