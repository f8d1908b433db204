// dpfast._C._ddp_check_*: dpfast.DistributedDataParallel's check in DDP's first gradient bucket, as a C++ comm hook.
//
// The protocol is dpfast/distributed/bucket_check.py's (read its docstring first): the first bucket's all-reduce
// carries a table of one row per rank after the gradients, and the table is read when backward() ends. There it
// is a Python hook, which costs a Python call per bucket and a dozen tensor calls from Python per step; here the
// hook, the table and the comparison are C++, and Python runs once per step: to give this rank's row when the
// first bucket is ready (the checks' chain lives in Python) and to take the result once backward has ended (to
// commit the step, or to build the error every rank raises). CPU buckets only: on CUDA reading the table would be
// a host-device sync, which the Python hook avoids by reading it a step later.
#include "ddp_check_hook.h"

#include <ATen/ScalarOps.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace dpfast {
namespace {

constexpr const char* kCapsule = "dpfast.ddp_check";

// bits per piece: every value of the table must be exact in the bucket's dtype (16-bit floats hold 8-bit pieces)
int piece_bits(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 ? 8 : 16; }
int64_t row_width(int bits) { return 2 + 64 / bits; }

// bucket_check.encode_row: (status, forwards, then the fingerprint's pieces), each below 2 ** bits
std::vector<double> encode_row(const std::array<int64_t, 3>& row, int bits) {
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  const uint64_t fp = static_cast<uint64_t>(row[1]);
  std::vector<double> out{double(uint64_t(row[0]) & mask), double(uint64_t(row[2]) & mask)};
  for (int k = 0; k < 64 / bits; ++k) out.push_back(double((fp >> (bits * k)) & mask));
  return out;
}

struct Pending {
  at::Tensor table;     // the all-reduced table (a view of the kept buffer)
  at::Tensor expected;  // what it holds when every rank's row is this rank's
  bool status_ok;       // this rank's own status is OK (else the rows cannot agree)
  int bits;
  c10::intrusive_ptr<c10::ivalue::Future> done;
};

// This rank's row in the bucket's dtype: zeros with it at row `rank`, and it repeated on every row (what an agreeing
// table holds). Remade when the row, dtype or width changes.
struct EncodedRow {
  std::array<int64_t, 3> row{};
  at::ScalarType dtype = at::kFloat;
  at::Tensor mine, everyone;
  bool status_ok = false;  // the row's status reads OK (else no table can agree)
};

struct CheckState {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t rank = 0, world = 1;
  PyObject* row_fn = nullptr;    // StepChecks.row: this rank's (status, fingerprint, forwards)
  PyObject* result_fn = nullptr;  // result_fn(None or table, bits): commit the step, or verify the rows (raises)

  // Guards what follows: the hook runs on an autograd thread, the entry points on Python's. Never held while
  // taking the GIL or running tensor operations (a dispatch mode may run Python in them).
  std::mutex mu;
  std::optional<EncodedRow> encoded;
  std::vector<at::Tensor> buffers;  // the first bucket's gradients and the table, one per (numel, dtype)
  std::optional<Pending> pending;
  std::shared_ptr<c10d::PythonCommHook> delegate;  // the Python hook, once the user registers one of theirs
  int64_t collectives = 0;

  ~CheckState() {
    if (!Py_IsInitialized()) return;  // the interpreter has gone: leak what it owned rather than touch it
    pybind11::gil_scoped_acquire gil;
    Py_XDECREF(row_fn);
    Py_XDECREF(result_fn);
    delegate.reset();
  }
};

[[noreturn]] void raise_python_error() {
  python_error e;
  e.persist();  // fetched now: the engine rethrows it on the thread that called backward()
  throw e;
}

// This rank's row, from Python (the GIL is taken here, never held by the caller)
std::array<int64_t, 3> current_row(CheckState& s) {
  pybind11::gil_scoped_acquire gil;
  PyObject* row = PyObject_CallNoArgs(s.row_fn);
  if (row == nullptr) raise_python_error();
  std::array<int64_t, 3> out{};
  PyObject* seq = PySequence_Fast(row, "StepChecks.row() must return a sequence");
  Py_DECREF(row);
  if (seq == nullptr) raise_python_error();
  const bool three = PySequence_Fast_GET_SIZE(seq) == 3;
  for (Py_ssize_t i = 0; three && i < 3; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (out[i] == -1 && PyErr_Occurred()) break;
  }
  Py_DECREF(seq);
  if (!three) PyErr_SetString(PyExc_RuntimeError, "dpfast: StepChecks.row() must return 3 integers");
  if (PyErr_Occurred()) raise_python_error();
  return out;
}

// Takes the pending table (if any) and hands the result to Python: None when it agrees, else the table.
void read(CheckState& s) {
  std::optional<Pending> p;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    p.swap(s.pending);
  }
  if (!p) return;
  p->done->waitAndThrow();  // finished already (the reducer, or its shadow of a backward, waited); raises if it failed
  const bool agreed = p->status_ok && at::equal(p->table, p->expected);
  pybind11::gil_scoped_acquire gil;
  PyObject* table = agreed ? (Py_INCREF(Py_None), Py_None) : THPVariable_Wrap(p->table);
  if (table == nullptr) raise_python_error();
  PyObject* out = PyObject_CallFunction(s.result_fn, "Oi", table, p->bits);
  Py_DECREF(table);
  if (out == nullptr) raise_python_error();
  Py_DECREF(out);
}

// The kept buffer for the first bucket's gradients and the table (a few shapes: DDP rebuilds its buckets once).
// Tensor work happens outside the lock: a dispatch mode active around backward() may run Python in it.
at::Tensor buffer_for(CheckState& s, int64_t numel, const at::TensorOptions& options) {
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& b : s.buffers) {
      if (b.numel() == numel && b.scalar_type() == options.dtype().toScalarType() && b.device() == options.device()) {
        return b;
      }
    }
  }
  at::Tensor made = at::empty({numel}, options);
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.buffers.size() >= 4) s.buffers.erase(s.buffers.begin());
  s.buffers.push_back(made);
  return made;
}

EncodedRow encoded_for(CheckState& s, const std::array<int64_t, 3>& row, int bits, at::ScalarType dtype) {
  const int64_t k = row_width(bits);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.encoded && s.encoded->row == row && s.encoded->dtype == dtype && s.encoded->mine.numel() == s.world * k) {
      return *s.encoded;
    }
  }
  const std::vector<double> values = encode_row(row, bits);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor one = at::tensor(values, f64);
  EncodedRow e;
  e.row = row;
  e.dtype = dtype;
  e.mine = at::zeros({s.world * k}, f64);
  e.mine.narrow(0, s.rank * k, k).copy_(one);
  e.mine = e.mine.to(dtype);  // exact: every value is below 2 ** bits
  e.everyone = one.repeat({s.world}).to(dtype);
  e.status_ok = values[0] == 0;  // the status piece, as decode_row reads it
  std::lock_guard<std::mutex> lock(s.mu);
  s.encoded = e;
  return e;
}

class CheckHook final : public c10d::CommHookInterface {
 public:
  explicit CheckHook(std::shared_ptr<CheckState> state) : s_(std::move(state)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::shared_ptr<c10d::PythonCommHook> delegate;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      delegate = s_->delegate;
    }
    if (delegate != nullptr) return delegate->runHook(bucket);  // the user's hook, through the Python check
    at::Tensor& buf = bucket.getBufferRef();
    // As DDP's reducer does without a hook (bit for bit): times 1 / W (a double scalar), then sum
    const double scale = 1.0 / static_cast<double>(s_->world);
    if (bucket.getIndex() != 0) {
      buf.mul_(scale);
      std::vector<at::Tensor> tensors{buf};
      {
        std::lock_guard<std::mutex> lock(s_->mu);
        ++s_->collectives;
      }
      return s_->group->allreduce(tensors)->getFuture();
    }
    TORCH_CHECK(buf.device().is_cpu(), "dpfast: the C++ check hook takes CPU buckets (", buf.device(), " given)");
    const std::array<int64_t, 3> row = current_row(*s_);
    const int bits = piece_bits(buf.scalar_type());
    const int64_t n = buf.numel(), k = row_width(bits);
    TORCH_CHECK(s_->world > 0 && s_->world <= (std::numeric_limits<int64_t>::max() - n) / k,
                "dpfast: a first bucket of ", n, " elements and ", s_->world, " ranks overflow the check's table");
    const EncodedRow e = encoded_for(*s_, row, bits, buf.scalar_type());
    at::Tensor full = buffer_for(*s_, n + s_->world * k, buf.options());
    full.narrow(0, n, s_->world * k).copy_(e.mine);
    at::Tensor head = full.narrow(0, 0, n);
    // backward(create_graph=True): the gradients have a graph; scaled in place as the reducer does, they keep it
    const bool graph = buf.requires_grad();
    if (graph) {
      buf.mul_(scale);
      at::NoGradGuard no_grad;
      head.copy_(buf);
    } else {
      at::mul_out(head, buf, at::native::wrapped_scalar_tensor(scale));  // the reducer's own call
    }
    std::vector<at::Tensor> tensors{full};
    auto done = s_->group->allreduce(tensors)->getFuture();
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      s_->pending = Pending{full.narrow(0, n, s_->world * k), e.everyone, e.status_ok, bits, done};
      ++s_->collectives;
    }
    queue_read_after_backward();
    // a failed all-reduce (a peer gone) fails the bucket, as the reducer's own would: never local gradients
    at::Tensor target = graph ? buf : at::Tensor();
    return done->then(
        [head, target](c10::ivalue::Future& f) {
          if (f.hasError()) std::rethrow_exception(f.exception_ptr());
          if (!target.defined()) return c10::IValue(head);
          at::NoGradGuard no_grad;
          at::Tensor into = target;  // the bucket, its graph kept, holding the summed values
          into.copy_(head);
          return c10::IValue(into);
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) {  // from the delegated Python hook
      std::shared_ptr<c10d::PythonCommHook> delegate;
      {
        std::lock_guard<std::mutex> lock(s_->mu);
        delegate = s_->delegate;
      }
      TORCH_CHECK(delegate != nullptr, "dpfast: a Python hook's result without the Python hook");
      return delegate->parseHookResult(result);
    }
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  // A callback queued now runs before the reducer's own (queued when its last bucket is ready), so it queues the
  // read behind it. Outside a backward (DDP's shadow of one) the caller reads the table.
  void queue_read_after_backward() {
    auto& engine = torch::autograd::Engine::get_default_engine();
    std::weak_ptr<CheckState> weak = s_;
    try {
      engine.queue_callback([weak] {
        torch::autograd::Engine::get_default_engine().queue_callback([weak] {
          if (auto s = weak.lock()) read(*s);
        });
      });
    } catch (const c10::Error&) {
    }
  }

  std::shared_ptr<CheckState> s_;
};

std::shared_ptr<CheckState>* state_of(PyObject* capsule) {
  return static_cast<std::shared_ptr<CheckState>*>(PyCapsule_GetPointer(capsule, kCapsule));
}

void free_state(PyObject* capsule) { delete state_of(capsule); }

// _ddp_check_install(reducer, process_group, rank, world, row_fn, result_fn) -> state: registers the hook
PyObject* ddp_check_install(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *reducer_obj, *group_obj, *row_fn, *result_fn;
  long long rank, world;
  if (!PyArg_ParseTuple(args, "OOLLOO", &reducer_obj, &group_obj, &rank, &world, &row_fn, &result_fn)) return nullptr;
  if (world < 1 || rank < 0 || rank >= world) {
    PyErr_Format(PyExc_ValueError, "dpfast: rank %lld of %lld ranks", rank, world);
    return nullptr;
  }
  if (!PyCallable_Check(row_fn) || !PyCallable_Check(result_fn)) {
    PyErr_SetString(PyExc_TypeError, "dpfast: row_fn and result_fn must be callables");
    return nullptr;
  }
  auto& reducer = pybind11::handle(reducer_obj).cast<c10d::Reducer&>();
  auto state = std::make_shared<CheckState>();
  state->group = pybind11::handle(group_obj).cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  state->rank = rank;
  state->world = world;
  Py_INCREF(row_fn);
  Py_INCREF(result_fn);
  state->row_fn = row_fn;
  state->result_fn = result_fn;
  reducer.register_comm_hook(std::make_unique<CheckHook>(state));
  auto* held = new std::shared_ptr<CheckState>(std::move(state));
  PyObject* capsule = PyCapsule_New(held, kCapsule, free_state);
  if (capsule == nullptr) delete held;
  return capsule;
  END_HANDLE_TH_ERRORS
}

// _ddp_check_delegate(state, hook): from now on every bucket goes through the Python hook `hook(None, bucket)`;
// `hook` None: through this C++ hook again
PyObject* ddp_check_delegate(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *capsule, *hook;
  if (!PyArg_ParseTuple(args, "OO", &capsule, &hook)) return nullptr;
  auto* s = state_of(capsule);
  if (s == nullptr) return nullptr;
  if (hook == Py_None) {
    std::lock_guard<std::mutex> lock((*s)->mu);
    (*s)->delegate.reset();
    Py_RETURN_NONE;
  }
  auto delegate = std::make_shared<c10d::PythonCommHook>(pybind11::none(),
                                                         pybind11::reinterpret_borrow<pybind11::object>(hook));
  std::lock_guard<std::mutex> lock((*s)->mu);
  (*s)->delegate = std::move(delegate);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _ddp_check_read(state): read a table that no backward's end read (DDP's shadow of a backward); may raise
PyObject* ddp_check_read(PyObject*, PyObject* capsule) {
  HANDLE_TH_ERRORS
  auto* s = state_of(capsule);
  if (s == nullptr) return nullptr;
  std::shared_ptr<CheckState> held = *s;
  read(*held);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// _ddp_check_collectives(state) -> int: the all-reduces this hook issued (the tests count collectives)
PyObject* ddp_check_collectives(PyObject*, PyObject* capsule) {
  auto* s = state_of(capsule);
  if (s == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock((*s)->mu);
  return PyLong_FromLongLong((*s)->collectives);
}

PyMethodDef methods[] = {
    {"_ddp_check_install", ddp_check_install, METH_VARARGS, "register the check's C++ comm hook on a DDP reducer"},
    {"_ddp_check_delegate", ddp_check_delegate, METH_VARARGS, "send every bucket through a Python hook instead"},
    {"_ddp_check_read", ddp_check_read, METH_O, "read a pending table now"},
    {"_ddp_check_collectives", ddp_check_collectives, METH_O, "the all-reduces the hook issued"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMethodDef* ddp_check_methods() { return methods; }

}  // namespace dpfast
