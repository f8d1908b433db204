// Private entry points of dpfast._C for the tests (python_hooks.cpp), added to the module in dpfast.cpp.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_hook_methods();  // null-terminated

}  // namespace dpfast
