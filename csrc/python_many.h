// dpfast._C._gather_many, _plain_batch, _narrow_many and _tensor_facts: a call's per-leaf work, in one call each.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_many_methods();  // null-terminated

}  // namespace dpfast
