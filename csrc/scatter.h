// scatter: split_contiguous on the source, then each chunk to its device.
#pragma once

#include "split_contiguous.h"

namespace dpfast {

inline void scatter_check(c10::SymIntArrayRef sizes, at::ArrayRef<c10::Device> devices) {
  TORCH_CHECK_VALUE(sizes.size() == devices.size(), "scatter: got ", sizes.size(), " sizes but ", devices.size(),
                    " devices; give one device per chunk size");
}

// Moves the packed chunks (flat, tensor-major) to their devices. Copies to a GPU go through
// Tensor::to(non_blocking=true), which orders them against the current streams of both devices without blocking
// the host; a copy to the CPU blocks, since the caller may read the chunk at once.
inline void scatter_move(std::vector<at::Tensor>& packed, at::ArrayRef<c10::Device> devices) {
  const size_t k = devices.size();
  for (size_t idx = 0; idx < packed.size(); ++idx) {
    const c10::Device& dev = devices[idx % k];
    if (packed[idx].device() != dev) packed[idx] = packed[idx].to(dev, /*non_blocking=*/dev.is_cuda());
  }
}

}  // namespace dpfast
