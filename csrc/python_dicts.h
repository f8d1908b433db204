// dpfast._C._same_dicts and _restore_dicts: a module tree's dicts checked and restored by identity, in one call.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_dict_methods();  // null-terminated

}  // namespace dpfast
