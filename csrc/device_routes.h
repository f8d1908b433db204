// Which GPUs a multi-device op or backward node must order its work against: plain logic on device lists, shared
// by the CUDA scatter and the backward nodes, and reachable from Python (testing/python_hooks.cpp) so that it is
// tested without a GPU.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace dpfast {

using DeviceList = c10::SmallVector<c10::Device, 8>;

// "cuda" without an index is the current CUDA device, as Tensor.to reads it. Compared as is with a tensor's
// "cuda:0" it would pass for another GPU.
inline c10::Device resolve_device(c10::Device d, c10::DeviceIndex current) {
  return d.is_cuda() && !d.has_index() ? c10::Device(c10::kCUDA, current) : d;
}

inline std::vector<c10::Device> resolve_devices(at::ArrayRef<c10::Device> devices, c10::DeviceIndex current) {
  std::vector<c10::Device> out;
  out.reserve(devices.size());
  for (const c10::Device& d : devices) out.push_back(resolve_device(d, current));
  return out;
}

// The distinct CUDA devices of `devices` other than `except`, in first-seen order (`devices` already resolved).
inline DeviceList other_cuda_devices(at::ArrayRef<c10::Device> devices, std::optional<c10::Device> except) {
  DeviceList out;
  for (const c10::Device& d : devices) {
    if (!d.is_cuda() || (except && d == *except) || std::find(out.begin(), out.end(), d) != out.end()) continue;
    out.push_back(d);
  }
  return out;
}

inline std::optional<c10::Device> first_cuda_device(at::ArrayRef<c10::Device> devices) {
  for (const c10::Device& d : devices) {
    if (d.is_cuda()) return d;
  }
  return std::nullopt;
}

// scatter from a GPU: the other GPUs its chunks go to, each served by one side stream. Empty when every chunk
// stays on the source (a [0, 0] rehearsal) or goes to the CPU: then no event or side stream is made at all.
inline DeviceList side_stream_devices(at::ArrayRef<c10::Device> resolved_devices, c10::Device source) {
  return other_cuda_devices(resolved_devices, source);
}

// A backward node's streams. The autograd engine orders a node against one stream only: the current stream,
// while the node runs, of the device of its first CUDA input (`own`). It makes that stream wait for every
// gradient the node receives, and the node's consumers wait for that stream alone. A node that reads or writes
// gradients on other GPUs (`others`) must bridge their current streams to its own.
struct NodeStreams {
  std::optional<c10::Device> own;
  DeviceList others;
};

// `input_devices`: the devices of the node's inputs (its gradients' metadata); `touched`: where it reads or
// writes tensors besides its own device.
inline NodeStreams node_streams(at::ArrayRef<c10::Device> input_devices, at::ArrayRef<c10::Device> touched) {
  NodeStreams s;
  s.own = first_cuda_device(input_devices);
  if (s.own) s.others = other_cuda_devices(touched, s.own);
  return s;
}

}  // namespace dpfast
