// dpfast._C._gather_many, _plain_batch, _narrow_many and _tensor_facts: a call's per-leaf work, in one call each.
#pragma once

#include <Python.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dpfast {

PyMethodDef* python_many_methods();  // null-terminated

// `tensors` cut to rows [start, start + length) where axes[i] != -1 (a view along axis 0, else a contiguous copy,
// made with the GIL released), as a new Python list; the uncut ones are the very objects. The caller has checked
// every cut (dense, its axis, the rows inside). nullptr with the error set if a wrap fails. Shared by
// _narrow_many and _kept_cut (python_kept.cpp).
PyObject* cut_to_list(std::vector<at::Tensor>& tensors, const std::vector<int64_t>& axes, int64_t start,
                      int64_t length);

}  // namespace dpfast
