// dpfast._C._kept_cut: a DistributedDataParallel call like the kept one, checked against it and cut, in one call.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_kept_methods();  // null-terminated

}  // namespace dpfast
