// What the fast entry points (python_many.cpp) count as a plain tensor to read, gather and cut.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dpfast {

inline bool dense(const at::Tensor& t) {
  return t.defined() && t.layout() == at::kStrided && !t.is_nested() && !t.is_quantized();
}

// Whether dpfast/trees/facts.py's memory_order may take `t` for channels_last (then Python moves it, through its
// NHWC view): any 4-d or 5-d tensor contiguous in that format, also one contiguous in both (its strides decide).
inline bool maybe_channels_last(const at::Tensor& t) {
  const int64_t nd = t.dim();
  const auto format = nd == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return (nd == 4 || nd == 5) && t.is_contiguous(format);
}

}  // namespace dpfast
