// Typed dispatcher handles of the dpfast ops, looked up once: backward nodes and the Python fast path call the
// ops through these, so every call still goes through autograd, modes and the device's kernel.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <vector>

namespace dpfast {

using Transpose01Fn = std::vector<at::Tensor>(at::TensorList);
using SplitFn = std::vector<at::Tensor>(at::TensorList, int64_t, c10::SymIntArrayRef);
using ScatterFn = std::vector<at::Tensor>(at::TensorList, int64_t, c10::SymIntArrayRef, at::ArrayRef<c10::Device>);
using GatherFn = at::Tensor(at::TensorList, int64_t, c10::Device);

template <class Fn>
c10::TypedOperatorHandle<Fn> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

inline const c10::TypedOperatorHandle<Transpose01Fn>& transpose01_op() {
  static const auto op = op_handle<Transpose01Fn>("dpfast::transpose01");
  return op;
}
inline const c10::TypedOperatorHandle<SplitFn>& split_op() {
  static const auto op = op_handle<SplitFn>("dpfast::split_contiguous");
  return op;
}
inline const c10::TypedOperatorHandle<ScatterFn>& scatter_op() {
  static const auto op = op_handle<ScatterFn>("dpfast::scatter");
  return op;
}
inline const c10::TypedOperatorHandle<GatherFn>& gather_op() {
  static const auto op = op_handle<GatherFn>("dpfast::gather");
  return op;
}

// A kernel or TorchDispatchMode may return any number of tensors for a dpfast op: check the count before anything
// indexes the result.
inline void check_output_count(const char* op, size_t got, size_t expected) {
  TORCH_CHECK(got == expected, "dpfast::", op, " returned ", got, " tensors where ", expected,
              " were expected; a kernel or TorchDispatchMode handling dpfast ops must return one tensor per output");
}

}  // namespace dpfast
