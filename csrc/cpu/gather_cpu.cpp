#include "../gather.h"
#include "copy_cpu.h"

#include <torch/library.h>

namespace dpfast {

// Chunks on the CPU: join them on the CPU in one pass, then move the result if the target is elsewhere.
at::Tensor gather_cpu(at::TensorList chunks, int64_t dim, c10::Device device) {
  std::vector<int64_t> shape;
  const int64_t d = gather_check(chunks, dim, shape);
  at::Tensor out = at::empty(shape, chunks[0].options());
  CopyBatch batch;
  gather_jobs(chunks, d, out, batch);
  run_copies_cpu(batch);
  return out.device() == device ? out : out.to(device);
}

TORCH_LIBRARY_IMPL(dpfast, CPU, m) { m.impl("gather", &gather_cpu); }

}  // namespace dpfast
