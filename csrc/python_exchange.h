// dpfast._C._pack_payload: one rank's bytes of DistributedDataParallel's output exchange, in one call.
#pragma once

#include <Python.h>

namespace dpfast {

PyMethodDef* python_exchange_methods();  // null-terminated

}  // namespace dpfast
