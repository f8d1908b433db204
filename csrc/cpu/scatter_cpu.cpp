#include "../scatter.h"
#include "copy_cpu.h"

#include <torch/library.h>

namespace dpfast {

// Sources on the CPU: pack every chunk in one pass (chunks of a pinned source bound for a GPU into pinned memory),
// then hand each to its device (CPU chunks stay put).
std::vector<at::Tensor> scatter_cpu(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes,
                                    at::ArrayRef<c10::Device> devices) {
  scatter_check(sizes, devices);
  CopyBatch batch;
  auto outs = split_jobs("scatter", xs, dim, sizes, batch, devices);
  run_copies_cpu(batch);
  scatter_move(outs, devices);
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CPU, m) { m.impl("scatter", &scatter_cpu); }

}  // namespace dpfast
