// dpfast._C._gather_many and _plain_batch: a DataParallel call's per-leaf work, in one call from Python each.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_many_methods();  // null-terminated

}  // namespace dpfast
