// Op schemas and the Python module dpfast._C. Kernels live in csrc/cpu and csrc/cuda, autograd in autograd.cpp.
#include "ddp_check_hook.h"
#include "python_calls.h"
#include "python_costs.h"
#include "python_dicts.h"
#include "python_many.h"

#include <Python.h>
#include <torch/library.h>

#ifndef DPFAST_CUDA_ARCH_LIST
#define DPFAST_CUDA_ARCH_LIST ""
#endif
#ifndef DPFAST_BUILT_WITH_TORCH
#define DPFAST_BUILT_WITH_TORCH "unknown"
#endif

// `import dpfast._C` loads this library, which registers the ops below as a side effect. The module carries
// build facts for dpfast.build_info(), the fast call path of dpfast/ops.py (python_calls.cpp), the exact
// arithmetic of cost-balanced splits (python_costs.cpp), a call's per-leaf facts, gathers and cuts in one call
// each (python_many.cpp), the replicas' identity checks of the module's dicts (python_dicts.cpp) and
// DistributedDataParallel's per-step check as a comm hook (ddp_check_hook.cpp). The tests' hooks are a module of
// their own (csrc/testing).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "dpfast fused data-movement ops", -1,
                                          dpfast::python_call_methods()};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddFunctions(m, dpfast::python_cost_methods()) < 0 ||
      PyModule_AddFunctions(m, dpfast::python_many_methods()) < 0 ||
      PyModule_AddFunctions(m, dpfast::python_dict_methods()) < 0 ||
      PyModule_AddFunctions(m, dpfast::ddp_check_methods()) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
#ifdef DPFAST_WITH_CUDA
  PyModule_AddIntConstant(m, "cuda_kernels_compiled", 1);
#else
  PyModule_AddIntConstant(m, "cuda_kernels_compiled", 0);
#endif
  PyModule_AddStringConstant(m, "cuda_arch_list", DPFAST_CUDA_ARCH_LIST);
  PyModule_AddStringConstant(m, "built_with_torch", DPFAST_BUILT_WITH_TORCH);
  return m;
}

TORCH_LIBRARY(dpfast, m) {
  // Fake kernels are registered from Python; this tells torch where to find them.
  m.impl_abstract_pystub("dpfast.ops");  // set_python_module in torch >= 2.5; this name works on 2.4 too
  m.def("transpose01(Tensor[] xs) -> Tensor[]");
  m.def("split_contiguous(Tensor[] xs, int dim, SymInt[] sizes) -> Tensor[]");
  m.def("scatter(Tensor[] xs, int dim, SymInt[] sizes, Device[] devices) -> Tensor[]");
  m.def("gather(Tensor[] chunks, int dim, Device device) -> Tensor");
}
