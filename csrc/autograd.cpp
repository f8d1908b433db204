// Autograd for the list-taking ops, written as hand-made backward nodes: torch::autograd::Function does not
// track tensors passed inside a TensorList, and registering autograd from Python would cost a Python round trip
// on every call. Backward calls the ops through the dispatcher, so double backward works too.
//
// transpose01 <- transpose01;  split_contiguous, scatter <- gather (per input tensor);  gather <- scatter.
#include "device_routes.h"
#include "op_handles.h"

#include <ATen/ops/zeros_like.h>
#include <c10/core/Event.h>
#include <c10/core/WrapDimMinimal.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <memory>
#include <type_traits>

namespace dpfast {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;
using NodePtr = decltype(torch::autograd::Edge::function);  // shared_ptr before torch 2.10, intrusive_ptr after

template <class T, class... A>
NodePtr make_node(A&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>(std::forward<A>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<A>(args)...);
  }
}

// Connects outputs to `node`. Output k comes from input `k / per_input` (per_input 0: from all of them); only the
// outputs of inputs that require grad are tracked (a mask split alongside x stays requires_grad=False, as with the
// reference), and integer and bool outputs carry no gradient. Untracked outputs keep a slot with undefined metadata.
void attach(const std::vector<at::Tensor>& outs, at::TensorList inputs, size_t per_input, const NodePtr& node) {
  for (size_t k = 0; k < outs.size(); ++k) {
    const at::Tensor& o = outs[k];
    const bool tracked = per_input == 0 || inputs[k / per_input].requires_grad();
    if (tracked && torch::autograd::isDifferentiableType(o.scalar_type())) {
      torch::autograd::set_history(o, node);
    } else {
      node->add_input_metadata(Node::undefined_input());
    }
  }
}

// ---- Streams of backward nodes that span devices (see NodeStreams in device_routes.h) ----
// Device-generic c10 events and streams, so this file needs no CUDA headers and builds without CUDA too.

std::vector<c10::Device> input_devices(const Node& node) {
  std::vector<c10::Device> devs;
  devs.reserve(node.num_inputs());
  for (size_t i = 0; i < node.num_inputs(); ++i) devs.push_back(node.input_metadata(i).device());
  return devs;
}

// The current streams of `others` wait for the current stream of `own` (before reading gradients there).
void others_wait_for_own(const NodeStreams& s) {
  if (!s.own || s.others.empty()) return;
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(impl.getStream(*s.own));
  for (const c10::Device& d : s.others) ready.block(impl.getStream(d));
}

// The current stream of `own` waits for the current streams of `others` (after writing gradients there).
void own_waits_for_others(const NodeStreams& s) {
  if (!s.own || s.others.empty()) return;
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  const c10::Stream own = impl.getStream(*s.own);
  for (const c10::Device& d : s.others) {
    c10::Event done(c10::DeviceType::CUDA);
    done.record(impl.getStream(d));
    done.block(own);
  }
}

// ---- Forward-mode AD: every op is linear, so an output's tangent is the op applied to the input tangents ----

bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// Indices of the inputs that carry a tangent, and those tangents.
std::vector<size_t> tangents_of(at::TensorList xs, std::vector<at::Tensor>& tangents) {
  std::vector<size_t> which;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (has_tangent(xs[i])) {
      which.push_back(i);
      tangents.push_back(xs[i]._fw_grad(/*level=*/0));
    }
  }
  return which;
}

// Output `which[k] * per_input + j` takes tangent `k * per_input + j` of `moved`.
void set_tangents(const char* op, std::vector<at::Tensor>& outs, const std::vector<size_t>& which, size_t per_input,
                  const std::vector<at::Tensor>& moved) {
  check_output_count(op, moved.size(), which.size() * per_input);
  for (size_t k = 0; k < which.size(); ++k) {
    for (size_t j = 0; j < per_input; ++j) {
      outs[which[k] * per_input + j]._set_fw_grad(moved[k * per_input + j], /*level=*/0, /*is_inplace_op=*/false);
    }
  }
}

struct Transpose01Backward : Node {
  std::string name() const override { return "dpfast::Transpose01Backward"; }
  variable_list apply(variable_list&& grads) override {
    std::vector<at::Tensor> defined;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined() && should_compute_output(i)) defined.push_back(grads[i]);
    }
    if (defined.empty()) return variable_list(grads.size());
    auto moved = transpose01_op().call(defined);  // all gradients in one launch
    check_output_count("transpose01", moved.size(), defined.size());
    variable_list out(grads.size());
    for (size_t i = 0, k = 0; i < grads.size(); ++i) {
      if (grads[i].defined() && should_compute_output(i)) out[i] = std::move(moved[k++]);
    }
    return out;
  }
};

// Backward of split_contiguous and scatter: gradient of input i = gather of its chunks' gradients.
struct SplitBackward : Node {
  SplitBackward(std::string n, int64_t d, size_t chunks, std::vector<c10::Device> devs)
      : op_name(std::move(n)), dim(d), n_chunks(chunks), source_devices(std::move(devs)) {}
  std::string op_name;
  int64_t dim;
  size_t n_chunks;
  std::vector<c10::Device> source_devices;  // one per input tensor

  std::string name() const override { return op_name; }
  variable_list apply(variable_list&& grads) override {
    const size_t n_inputs = source_devices.size();
    TORCH_CHECK(grads.size() == n_inputs * n_chunks, op_name, " got ", grads.size(), " gradients for ", n_inputs,
                " tensors of ", n_chunks, " chunks");
    // The engine made this node's own stream wait for every gradient; gather reads the chunks on other GPUs on
    // their devices' current streams (a copy to the CPU waits for nothing else), so those must wait for it too.
    const auto devs = input_devices(*this);
    others_wait_for_own(node_streams(devs, devs));
    variable_list out(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) {
      if (!should_compute_output(i)) continue;
      bool any = false;
      for (size_t j = 0; j < n_chunks; ++j) any = any || grads[i * n_chunks + j].defined();
      if (!any) continue;
      std::vector<at::Tensor> parts;
      parts.reserve(n_chunks);
      for (size_t j = 0; j < n_chunks; ++j) {
        const size_t idx = i * n_chunks + j;
        parts.push_back(grads[idx].defined() ? grads[idx] : input_metadata(idx).zeros_like());
      }
      out[i] = gather_op().call(parts, dim, source_devices[i]);
    }
    return out;
  }
};

struct GatherBackward : Node {
  GatherBackward(int64_t d, std::vector<c10::SymInt> s, std::vector<c10::Device> devs)
      : dim(d), sizes(std::move(s)), devices(std::move(devs)) {}
  int64_t dim;
  std::vector<c10::SymInt> sizes;
  std::vector<c10::Device> devices;

  std::string name() const override { return "dpfast::GatherBackward"; }
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return variable_list(sizes.size());
    auto parts = scatter_op().call({grads[0]}, dim, sizes, devices);
    check_output_count("scatter", parts.size(), sizes.size());
    // Parts for other GPUs are ready on those devices' current streams (copied on side streams), but the
    // engine's consumers wait only for this node's own stream: make it wait for theirs.
    own_waits_for_others(node_streams(input_devices(*this), devices));
    return variable_list(std::make_move_iterator(parts.begin()), std::make_move_iterator(parts.end()));
  }
};

std::vector<c10::Device> devices_of(at::TensorList xs) {
  std::vector<c10::Device> devs;
  devs.reserve(xs.size());
  for (const at::Tensor& x : xs) devs.push_back(x.device());
  return devs;
}

// ---- Autograd kernels: run the op below autograd, then record the backward node if any input needs it ----

std::vector<at::Tensor> transpose01_autograd(at::TensorList xs) {
  std::vector<at::Tensor> outs;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    outs = transpose01_op().call(xs);
  }
  check_output_count("transpose01", outs.size(), xs.size());
  if (torch::autograd::compute_requires_grad(xs)) {
    auto node = make_node<Transpose01Backward>();
    node->set_next_edges(torch::autograd::collect_next_edges(xs));
    attach(outs, xs, 1, node);
  }
  std::vector<at::Tensor> tangents;
  const auto which = tangents_of(xs, tangents);
  if (!which.empty()) set_tangents("transpose01", outs, which, 1, transpose01_op().call(tangents));
  return outs;
}

std::vector<at::Tensor> split_contiguous_autograd(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes) {
  std::vector<at::Tensor> outs;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    outs = split_op().call(xs, dim, sizes);
  }
  check_output_count("split_contiguous", outs.size(), xs.size() * sizes.size());
  if (torch::autograd::compute_requires_grad(xs)) {
    auto node = make_node<SplitBackward>("dpfast::SplitContiguousBackward", dim, sizes.size(), devices_of(xs));
    node->set_next_edges(torch::autograd::collect_next_edges(xs));
    attach(outs, xs, sizes.size(), node);
  }
  std::vector<at::Tensor> tangents;
  const auto which = tangents_of(xs, tangents);
  if (!which.empty()) set_tangents("split_contiguous", outs, which, sizes.size(), split_op().call(tangents, dim, sizes));
  return outs;
}

std::vector<at::Tensor> scatter_autograd(at::TensorList xs, int64_t dim, c10::SymIntArrayRef sizes,
                                         at::ArrayRef<c10::Device> devices) {
  std::vector<at::Tensor> outs;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    outs = scatter_op().call(xs, dim, sizes, devices);
  }
  check_output_count("scatter", outs.size(), xs.size() * sizes.size());
  if (torch::autograd::compute_requires_grad(xs)) {
    auto node = make_node<SplitBackward>("dpfast::ScatterBackward", dim, sizes.size(), devices_of(xs));
    node->set_next_edges(torch::autograd::collect_next_edges(xs));
    attach(outs, xs, sizes.size(), node);
  }
  std::vector<at::Tensor> tangents;
  const auto which = tangents_of(xs, tangents);
  if (!which.empty()) set_tangents("scatter", outs, which, sizes.size(), scatter_op().call(tangents, dim, sizes, devices));
  return outs;
}

at::Tensor gather_autograd(at::TensorList chunks, int64_t dim, c10::Device device) {
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = gather_op().call(chunks, dim, device);
  }
  if (torch::autograd::compute_requires_grad(chunks)) {
    std::vector<c10::SymInt> sizes;
    sizes.reserve(chunks.size());
    for (const at::Tensor& c : chunks) sizes.push_back(c.sym_size(c10::maybe_wrap_dim(dim, c.dim())));
    auto node = make_node<GatherBackward>(dim, std::move(sizes), devices_of(chunks));
    node->set_next_edges(torch::autograd::collect_next_edges(chunks));
    attach({out}, chunks, 0, node);
  }
  bool any_tangent = false;
  for (const at::Tensor& c : chunks) any_tangent = any_tangent || has_tangent(c);
  if (any_tangent) {
    std::vector<at::Tensor> parts;
    parts.reserve(chunks.size());
    for (const at::Tensor& c : chunks) parts.push_back(has_tangent(c) ? c._fw_grad(/*level=*/0) : at::zeros_like(c));
    out._set_fw_grad(gather_op().call(parts, dim, device), /*level=*/0, /*is_inplace_op=*/false);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dpfast, Autograd, m) {
  m.impl("transpose01", &transpose01_autograd);
  m.impl("split_contiguous", &split_contiguous_autograd);
  m.impl("scatter", &scatter_autograd);
  m.impl("gather", &gather_autograd);
}

}  // namespace dpfast
