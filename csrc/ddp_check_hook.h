// dpfast._C._ddp_check_*: DistributedDataParallel's per-step check as a C++ comm hook (ddp_check_hook.cpp).
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* ddp_check_methods();  // null-terminated

}  // namespace dpfast
