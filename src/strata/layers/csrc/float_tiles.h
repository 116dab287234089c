// What Strata's CPU kernels share: a register tile of 16 floats as a GCC/Clang vector type (one AVX-512
// register, two AVX2 ones, four NEON ones), and the horizontal sums of 16 such tiles at once.
#pragma once

namespace strata_kernels {

constexpr int kLanes = 16;
using FloatTile = float __attribute__((vector_size(kLanes * sizeof(float))));

// Lane t of the result is the sum of x[t]'s lanes, for kLanes tiles x (overwritten). Pairs of tiles are
// merged by adding their halves, then quarters, ...: 15 merges of 3 vector operations for 16 sums, where
// summing each tile by itself would take 16 dependent chains of 8.
inline FloatTile lane_sums(FloatTile* x) {
  static_assert(kLanes == 16, "the shuffles below are written for 16 lanes");
  for (int i = 0; i < 8; ++i) {
    const FloatTile a = x[2 * i], b = x[2 * i + 1];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    const FloatTile a = x[2 * i], b = x[2 * i + 1];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    const FloatTile a = x[2 * i], b = x[2 * i + 1];
    x[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

}  // namespace strata_kernels
