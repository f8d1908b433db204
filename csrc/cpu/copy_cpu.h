// CPU executor of a CopyBatch.
#pragma once

#include "../copy_jobs.h"

namespace dpfast {

void run_copies_cpu(const CopyBatch& batch);

}  // namespace dpfast
