// CUDA executor of a CopyBatch: one kernel launch on the current stream of the current device.
#pragma once

#include "../copy_jobs.h"

namespace dpfast {

// The caller sets the device (CUDAGuard); every job must live on it.
void run_copies_cuda(const CopyBatch& batch);

}  // namespace dpfast
