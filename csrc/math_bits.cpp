// Inputs with a lazy negation or conjugation bit (x.conj() of a complex tensor, x.conj().imag, torch._neg_view):
// the kernels move raw bytes, so such a view must be materialized first. torch's own fallback for these keys
// negates through another kernel than Tensor.resolve_neg(), and the two quiet signalling NaNs of half-precision
// types differently; resolving here with resolve_conj()/resolve_neg(), exactly as dpfast.reference does, keeps
// every path bit-identical to the reference.
#include "op_handles.h"

#include <torch/library.h>

namespace dpfast {
namespace {

std::vector<at::Tensor> resolved(at::TensorList xs) {
  std::vector<at::Tensor> out;
  out.reserve(xs.size());
  for (const at::Tensor& x : xs) out.push_back(x.defined() ? x.resolve_conj().resolve_neg() : x);
  return out;
}

// The resolved tensors carry neither bit, so the second call goes on to the device kernels.
std::vector<at::Tensor> transpose01_resolved(at::TensorList xs) { return transpose01_op().call(resolved(xs)); }

std::vector<at::Tensor> split_resolved(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes) {
  return split_op().call(resolved(xs), dim, sizes);
}

std::vector<at::Tensor> scatter_resolved(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes,
                                         at::ArrayRef<c10::Device> devices) {
  return scatter_op().call(resolved(xs), dim, sizes, devices);
}

at::Tensor gather_resolved(at::TensorList chunks, int64_t dim, c10::Device device) {
  return gather_op().call(resolved(chunks), dim, device);
}

void register_resolving(torch::Library& m) {
  m.impl("transpose01", &transpose01_resolved);
  m.impl("split_contiguous", &split_resolved);
  m.impl("scatter", &scatter_resolved);
  m.impl("gather", &gather_resolved);
}

}  // namespace

TORCH_LIBRARY_IMPL(dpfast, Negative, m) { register_resolving(m); }
TORCH_LIBRARY_IMPL(dpfast, Conjugate, m) { register_resolving(m); }

}  // namespace dpfast
