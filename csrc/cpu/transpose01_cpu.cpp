#include "../transpose01.h"
#include "copy_cpu.h"

#include <torch/library.h>

namespace dpfast {

std::vector<at::Tensor> transpose01_cpu(at::TensorList xs) {
  CopyBatch batch;
  auto outs = transpose01_jobs(xs, batch);
  run_copies_cpu(batch);
  return outs;
}

TORCH_LIBRARY_IMPL(dpfast, CPU, m) { m.impl("transpose01", &transpose01_cpu); }

}  // namespace dpfast
