// CPU executor of a CopyBatch.
#pragma once

#include "../copy_plan.h"

namespace dpfast {

void run_copies_cpu(const CopyBatch& batch);

}  // namespace dpfast
