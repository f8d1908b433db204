#include "../split_contiguous.h"
#include "copy_cpu.h"

#include <torch/library.h>

namespace dpfast {

std::vector<at::Tensor> split_contiguous_cpu(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes) {
  CopyBatch batch;
  auto outs = split_jobs("split_contiguous", xs, dim, sizes, batch);
  run_copies_cpu(batch);
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CPU, m) { m.impl("split_contiguous", &split_contiguous_cpu); }

}  // namespace dpfast
