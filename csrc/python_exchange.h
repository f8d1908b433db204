// dpfast._C._pack_payload, _int_rows and _blocks: DistributedDataParallel's output exchange, in one call each.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_exchange_methods();  // null-terminated

}  // namespace dpfast
