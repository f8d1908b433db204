// scatter: split_contiguous on the source, then each chunk to its device.
#pragma once

#include "split_contiguous.h"

namespace dpfast {

inline void scatter_check(c10::SymIntArrayRef sizes, at::ArrayRef<c10::Device> devices) {
  TORCH_CHECK_VALUE(sizes.size() == devices.size(), "scatter: got ", sizes.size(), " sizes but ", devices.size(),
                    " devices; give one device per chunk size");
}

// Moves the packed chunks (flat, tensor-major) to their devices. Cross-device copies go through
// Tensor::to(non_blocking=true), which on CUDA orders the copy against the current streams of both devices
// and does not block the host.
inline void scatter_move(std::vector<at::Tensor>& packed, at::ArrayRef<c10::Device> devices) {
  const size_t k = devices.size();
  for (size_t idx = 0; idx < packed.size(); ++idx) {
    const c10::Device& dev = devices[idx % k];
    if (packed[idx].device() != dev) packed[idx] = packed[idx].to(dev, /*non_blocking=*/true);
  }
}

}  // namespace dpfast
