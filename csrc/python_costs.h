// dpfast._C._exact_prefix and _balanced_bounds: the exact arithmetic of cost-balanced splits in 128 bits.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_cost_methods();  // null-terminated

}  // namespace dpfast
