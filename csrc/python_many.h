// dpfast._C._gather_many, _narrow_many, _leaf_facts and _batch_size: a call's per-leaf work, in one call each.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_many_methods();  // null-terminated

}  // namespace dpfast
