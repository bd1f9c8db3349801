// with_rows_upto<N>(n, f): f(std::integral_constant<int, n>{}) for n in 1 .. N, so a kernel's row
// count is a compile-time constant (unrolled loops, accumulators in registers). Shared by the
// attention and quant_linear kernels.
#pragma once

#include <cstdint>
#include <type_traits>

namespace kaiten {

template <int N, typename F>
inline void with_rows_upto(int64_t n, const F& f) {
  if constexpr (N > 0) {
    if (n == N) f(std::integral_constant<int, N>{});
    else with_rows_upto<N - 1>(n, f);
  }
}

}  // namespace kaiten
