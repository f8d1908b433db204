// Argument checks shared by every op and device. Messages name the argument and say how to fix it; the error
// types (ValueError, IndexError) match dpfast.reference so both paths fail alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/SymInt.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include "overflow.h"

#include <cctype>
#include <string>
#include <vector>

namespace dpfast {

// A shape as Python prints it, "(3,)" or "(2, 4)", so messages read the same from C++ and from dpfast.reference.
inline std::string shape_str(c10::IntArrayRef shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

inline std::string list_str(c10::IntArrayRef values) {
  std::string s = "[";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + "]";
}

// A dtype as Python prints it ("torch.float32"), so messages read the same from C++ and from dpfast.reference.
inline std::string dtype_str(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "torch.float32";
    case c10::ScalarType::Double: return "torch.float64";
    case c10::ScalarType::Half: return "torch.float16";
    case c10::ScalarType::ComplexHalf: return "torch.complex32";
    case c10::ScalarType::ComplexFloat: return "torch.complex64";
    case c10::ScalarType::ComplexDouble: return "torch.complex128";
    case c10::ScalarType::Long: return "torch.int64";
    case c10::ScalarType::Int: return "torch.int32";
    case c10::ScalarType::Short: return "torch.int16";
    case c10::ScalarType::Char: return "torch.int8";
    case c10::ScalarType::Byte: return "torch.uint8";
    default: break;
  }
  std::string name = c10::toString(t);  // the rest are Python's names capitalized: BFloat16, Bool, Float8_e5m2
  for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return "torch." + name;
}

// `dim` of `x` (the i-th tensor of the `what` list), wrapped to [0, x.dim()).
inline int64_t wrap_dim(const char* op, const char* what, size_t i, const at::Tensor& x, int64_t dim) {
  TORCH_CHECK_VALUE(x.dim() > 0, op, ": ", what, "[", i, "] is 0-dim; it has no dim ", dim, " to split or join");
  TORCH_CHECK_INDEX(dim >= -x.dim() && dim < x.dim(), op, ": dim ", dim, " is out of range for ", what, "[", i,
                    "] of shape ", shape_str(x.sizes()), " (expected a dim in [", -x.dim(), ", ", x.dim() - 1, "])");
  return dim < 0 ? dim + x.dim() : dim;
}

inline void check_same_device(const char* op, at::TensorList xs) {
  for (size_t i = 1; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].device() == xs[0].device(), op, ": tensors[", i, "] is on ", xs[i].device(),
                      " but tensors[0] is on ", xs[0].device(), "; move all tensors to one device");
  }
}

inline void check_defined(const char* op, const char* what, at::TensorList xs) {
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].defined(), op, ": ", what, "[", i, "] is an undefined tensor");
  }
}

// The number of elements of `shape` and its size in bytes, refused (ValueError, as dpfast.reference does) when
// either passes 2^63 - 1: a wrapped count would allocate a small output and copy a large input into it.
inline int64_t checked_nbytes(const char* op, const char* what, c10::IntArrayRef shape, int64_t element_size) {
  int64_t n = 1;
  bool overflow = false;
  for (int64_t s : shape) overflow |= c10::mul_overflows(n, s, &n);
  overflow |= c10::mul_overflows(n, element_size, &n);
  TORCH_CHECK_VALUE(!overflow, op, ": ", what, " of shape ", shape_str(shape), " would hold more than 2**63 - 1 bytes");
  return n;
}

// Concrete chunk sizes: each >= 0, summing to the size of `dim` in every tensor. A negative `dim` wraps per
// tensor (the tensors may differ in rank), so callers wrap it for each tensor themselves.
inline void check_split(const char* op, at::TensorList xs, int64_t dim, c10::SymIntArrayRef sym_sizes,
                           std::vector<int64_t>& sizes) {
  check_defined(op, "tensors", xs);
  check_same_device(op, xs);
  sizes.clear();
  int64_t total = 0;
  for (size_t j = 0; j < sym_sizes.size(); ++j) {
    const int64_t s = sym_sizes[j].guard_int(__FILE__, __LINE__);
    TORCH_CHECK_VALUE(s >= 0, op, ": sizes[", j, "] is ", s, "; chunk sizes must be >= 0");
    sizes.push_back(s);
  }
  for (size_t j = 0; j < sizes.size(); ++j) {
    TORCH_CHECK_VALUE(!dpfast::add_overflows(total, sizes[j], &total), op, ": sizes ", list_str(sizes),
                      " sum past 2**63 - 1; the sizes must sum to the size of dim ", dim);
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    const int64_t wrapped = wrap_dim(op, "tensors", i, xs[i], dim);
    TORCH_CHECK_VALUE(total == xs[i].size(wrapped), op, ": sizes ", list_str(sizes), " sum to ", total,
                      " but tensors[", i, "] has size ", xs[i].size(wrapped), " along dim ", dim, " (shape ",
                      shape_str(xs[i].sizes()), "); the sizes must sum to that axis");
  }
}

}  // namespace dpfast
