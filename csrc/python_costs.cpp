// Exact arithmetic for cost-balanced splits, in 128-bit integers: dpfast._C._exact_prefix and
// dpfast._C._balanced_bounds. dpfast/plan/costs.py and dpfast/plan/splits.py hold the same arithmetic on Python
// ints: that is the reference, and it runs where these decline (numbers wider than kBits) or the extension is not
// loaded.
// Here B costs are read and split without building B Python integers, which is what made float costs slow.
#include "python_costs.h"

#include "python_args.h"
#include "python_fast.h"

#include <ATen/ops/empty.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

namespace dpfast {
namespace {

using i128 = __int128;
using u128 = unsigned __int128;

// Every prefix sum stays below 2^kBits. The search then adds a prefix sum to a cap below 2^126 and halves a sum of
// two values below 2^126: all of it below 2^127, so nothing here can overflow.
constexpr int kBits = 125;
constexpr i128 kLimit = static_cast<i128>(1) << kBits;

int bit_length(uint64_t v) { return v == 0 ? 0 : 64 - __builtin_clzll(v); }

// Whether a strided CPU tensor's elements lie inside its allocated storage (a storage can be resized under it).
bool inside_storage(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  if (!t.has_storage() || t.storage().data() == nullptr) return false;
  const int64_t items = static_cast<int64_t>(t.storage().nbytes()) / static_cast<int64_t>(t.element_size());
  return t.storage_offset() >= 0 && t.storage_offset() <= items && t.numel() <= items - t.storage_offset();
}

// `t` when it is a plain contiguous CPU tensor of `dim` dimensions whose memory holds its values as they read (no
// negated or zero-tensor view), else a ValueError naming `what`.
at::Tensor checked_tensor(at::Tensor t, int64_t dim, const char* what) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.is_cpu() && t.layout() == at::kStrided && t.is_contiguous(), what,
                    " must be a contiguous ", dim, "-D CPU tensor");
  TORCH_CHECK_VALUE(!t.is_neg() && !t.is_conj() && !t._is_zerotensor(), what,
                    " must not be a negated, conjugated or zero-tensor view (resolve it first)");
  TORCH_CHECK_VALUE(inside_storage(t), what, " reaches past its storage");
  return t;
}

// A value below 2^127 from its (high, low) 64-bit halves, as _splits.py passes them.
i128 from_halves(PyObject* high, PyObject* low, const char* what) {
  TORCH_CHECK_TYPE(PyLong_Check(high) && PyLong_Check(low), what, " must be ints");
  const int64_t h = as_int64(high, what);
  TORCH_CHECK_VALUE(h >= 0 && h < (INT64_C(1) << 62), what, " is out of range");
  const unsigned long long l = PyLong_AsUnsignedLongLong(low);
  if (l == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw python_error();
    PyErr_Clear();  // negative, or 64 bits or more
    TORCH_CHECK_VALUE(false, what, " is out of range");
  }
  return static_cast<i128>((static_cast<u128>(h) << 64) | l);
}

// Sample i's cost as m * 2^e with an odd m (or m = 0); false when it is negative or not finite.
bool decompose(double x, uint64_t& m, int& e) {
  if (!std::isfinite(x) || x < 0) return false;
  if (x == 0) {
    m = 0, e = 0;
    return true;
  }
  int exp = 0;
  const double f = std::frexp(x, &exp);  // x = f * 2^exp, 0.5 <= f < 1, also for subnormals
  m = static_cast<uint64_t>(std::ldexp(f, 53));  // exact: a double has at most 53 significant bits
  const int tz = __builtin_ctzll(m);
  m >>= tz;
  e = exp - 53 + tz;
  return true;
}

// _exact_prefix(costs) -> (bad, e, prefix). `costs`: a contiguous 1-D CPU float64 or int64 tensor of B costs.
// bad: the first sample that is negative or not finite (then e and prefix are None), else -1. Otherwise each cost
// is an integer times 2^e (e <= 0; e = 0 for int64), and prefix is a (B + 1, 2) int64 tensor holding the prefix
// sums of those integers as (high, low) halves of 128 bits; prefix is None when a sum reaches 2^kBits.
PyObject* py_exact_prefix(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 1, "_exact_prefix(costs) takes one tensor");
  const at::Tensor t = checked_tensor(unpack_tensor(args[0], "costs"), 1, "costs");
  const bool is_float = t.scalar_type() == at::kDouble;
  TORCH_CHECK_TYPE(is_float || t.scalar_type() == at::kLong, "costs must be float64 or int64");
  const int64_t n = t.numel();
  std::vector<uint64_t> mant(static_cast<size_t>(n));
  std::vector<int> exps(static_cast<size_t>(n), 0);
  int e_min = 0;  // integers stay integers: the scale is 1 unless some cost has a fraction
  if (is_float) {
    const double* x = t.const_data_ptr<double>();
    for (int64_t i = 0; i < n; ++i) {
      if (!decompose(x[i], mant[i], exps[i])) {
        return Py_BuildValue("(LOO)", static_cast<long long>(i), Py_None, Py_None);
      }
      if (mant[i] != 0) e_min = std::min(e_min, exps[i]);
    }
  } else {
    const int64_t* x = t.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] < 0) return Py_BuildValue("(LOO)", static_cast<long long>(i), Py_None, Py_None);
      mant[i] = static_cast<uint64_t>(x[i]);
    }
  }
  auto too_wide = [e_min] { return Py_BuildValue("(LiO)", -1LL, e_min, Py_None); };
  at::Tensor prefix = at::empty({n + 1, 2}, t.options().dtype(at::kLong));
  int64_t* out = prefix.mutable_data_ptr<int64_t>();
  i128 sum = 0;
  out[0] = out[1] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (mant[i] != 0) {
      const int shift = exps[i] - e_min;  // >= 0
      if (shift >= kBits || bit_length(mant[i]) + shift > kBits) return too_wide();
      const i128 v = static_cast<i128>(mant[i]) << shift;
      if (v >= kLimit - sum) return too_wide();
      sum += v;
    }
    out[2 * (i + 1)] = static_cast<int64_t>(sum >> 64);
    out[2 * (i + 1) + 1] = static_cast<int64_t>(static_cast<uint64_t>(static_cast<u128>(sum)));
  }
  PyObject* p = THPVariable_Wrap(std::move(prefix));
  if (p == nullptr) return nullptr;
  return Py_BuildValue("(LiN)", -1LL, e_min, p);
  END_HANDLE_TH_ERRORS
}

// The prefix sums of a (B + 1, 2) int64 tensor of 128-bit (high, low) halves: starting at 0, never decreasing.
std::vector<i128> read_prefix(const at::Tensor& t) {
  checked_tensor(t, 2, "prefix");
  TORCH_CHECK_VALUE(t.size(1) == 2 && t.size(0) >= 1 && t.scalar_type() == at::kLong,
                    "prefix must be a contiguous CPU int64 tensor of shape (B + 1, 2)");
  const int64_t* p = t.const_data_ptr<int64_t>();
  std::vector<i128> out(static_cast<size_t>(t.size(0)));
  for (int64_t i = 0; i < t.size(0); ++i) {
    TORCH_CHECK_VALUE(p[2 * i] >= 0 && p[2 * i] < (INT64_C(1) << (kBits - 64)), "prefix[", i, "] is out of range");
    out[i] = static_cast<i128>((static_cast<u128>(p[2 * i]) << 64) | static_cast<uint64_t>(p[2 * i + 1]));
    TORCH_CHECK_VALUE(i == 0 ? out[0] == 0 : out[i] >= out[i - 1], "prefix sums must start at 0 and never decrease");
  }
  return out;
}

// The search of dpfast.plan.splits.balanced_split for k devices, on the prefix sums P of _exact_prefix.
struct BalancedSearch {
  std::vector<i128> P;           // P[i]: the summed cost of samples [0, i)
  std::vector<int64_t> mult;     // the k positive multipliers
  std::vector<int64_t> targets;  // the count split's k cumulative ends
  int64_t batch;

  // the last index in [start, batch] whose prefix sum is <= x (x >= P[start])
  int64_t reach(int64_t start, i128 x) const {
    return static_cast<int64_t>(std::upper_bound(P.begin() + start, P.end(), x) - P.begin()) - 1;
  }

  // the largest counted cost of the greedy split at cap u, or -1 when it leaves samples over
  i128 covers(i128 u) const {
    int64_t end = 0;
    i128 top = 0;
    for (const int64_t m : mult) {
      const int64_t start = end;
      end = reach(start, P[start] + u / m);
      top = std::max(top, (P[end] - P[start]) * m);
      if (end == batch) return top;
    }
    return -1;
  }

  // the smallest cap in [lo, hi] whose greedy split covers the batch (hi does)
  i128 optimum(i128 lo, i128 hi) const {
    while (lo < hi) {
      const i128 mid = (lo + hi) / 2;
      const i128 top = covers(mid);
      if (top < 0) {
        lo = mid + 1;
      } else {
        hi = top;
      }
    }
    return lo;
  }

  // k + 1 boundaries within the optimum's caps, each as near the count split's as the caps allow
  std::vector<int64_t> bounds(i128 best) const {
    const size_t k = mult.size();
    std::vector<i128> caps(k);
    for (size_t j = 0; j < k; ++j) caps[j] = best / mult[j];
    std::vector<int64_t> low(k + 1, 0), out{0};
    low[k] = batch;
    for (size_t j = k - 1; j >= 1; --j) {
      low[j] = static_cast<int64_t>(std::lower_bound(P.begin(), P.begin() + low[j + 1], P[low[j + 1]] - caps[j]) -
                                    P.begin());
    }
    for (size_t j = 0; j + 1 < k; ++j) {
      const int64_t start = out.back();
      out.push_back(std::min(std::max({targets[j], low[j + 1], start}), reach(start, P[start] + caps[j])));
    }
    out.push_back(batch);
    return out;
  }
};

// _balanced_bounds(prefix, mult, targets, lo_high, lo_low, hi_high, hi_low) -> list of k + 1 bounds: the search of
// dpfast.plan.splits.balanced_split for k devices, on the prefix sums of _exact_prefix. mult: the k positive
// multipliers, targets: the count split's k cumulative ends, lo and hi: the first bracket of the optimum. The
// caller keeps every cost times its multiplier below 2^126 (so hi is, too).
PyObject* py_balanced_bounds(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 7, "_balanced_bounds(prefix, mult, targets, lo_high, lo_low, hi_high, hi_low)");
  const HeldItems mult_items(args[1], "mult"), target_items(args[2], "targets");
  BalancedSearch search{read_prefix(unpack_tensor(args[0], "prefix")), int_list(mult_items, "mult"),
                        int_list(target_items, "targets"), 0};
  const i128 lo = from_halves(args[3], args[4], "lo"), hi = from_halves(args[5], args[6], "hi");
  const std::vector<i128>& P = search.P;
  const int64_t batch = search.batch = static_cast<int64_t>(P.size()) - 1;
  const size_t k = search.mult.size();
  TORCH_CHECK_VALUE(k >= 1 && search.targets.size() == k, "mult and targets must hold one entry per device");
  for (size_t j = 0; j < k; ++j) {
    const int64_t m = search.mult[j], target = search.targets[j];
    TORCH_CHECK_VALUE(m >= 1, "mult[", j, "] must be >= 1");
    TORCH_CHECK_VALUE(target >= 0 && target <= batch && (j == 0 || target >= search.targets[j - 1]),
                      "targets must be cumulative sizes within the batch");
    TORCH_CHECK_VALUE(P[batch] <= (static_cast<i128>(1) << 126) / m, "a cost times mult[", j, "] reaches 2^126");
  }
  TORCH_CHECK_VALUE(lo >= 0 && lo <= hi && hi < (static_cast<i128>(1) << 126), "lo and hi must bracket the optimum");
  return int_list_object(search.bounds(search.optimum(lo, hi)));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_exact_prefix", DPFAST_FASTCALL(py_exact_prefix), "per-sample costs as 128-bit prefix sums (plan/costs.py)"},
    {"_balanced_bounds", DPFAST_FASTCALL(py_balanced_bounds), "the cost-balanced split's search (plan/splits.py)"},
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace

PyMethodDef* python_cost_methods() { return methods; }

}  // namespace dpfast
