// Signed overflow checks that build on every supported torch (>= 2.4): c10::add_overflows takes only uint64_t in
// torch 2.4 and 2.8 (newer torch has a template); c10::mul_overflows has had an int64_t overload throughout.
#pragma once

#include <cstdint>

namespace dpfast {

inline bool add_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_add_overflow(a, b, out); }

}  // namespace dpfast
