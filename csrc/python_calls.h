// The fast Python entry points of dpfast._C (python_calls.cpp), added to the module in dpfast.cpp.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_call_methods();  // null-terminated

}  // namespace dpfast
