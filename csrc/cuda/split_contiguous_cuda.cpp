// Host side of split_contiguous on CUDA: every chunk of every tensor in one launch.
#include "../split_contiguous.h"
#include "copy_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace dpfast {

std::vector<at::Tensor> split_contiguous_cuda(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes) {
  check_same_device("split_contiguous", xs);
  const c10::cuda::CUDAGuard guard(xs[0].device());
  CopyBatch batch;
  auto outs = split_jobs("split_contiguous", xs, dim, sizes, batch);
  run_copies_cuda(batch);
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CUDA, m) { m.impl("split_contiguous", &split_contiguous_cuda); }

}  // namespace dpfast
