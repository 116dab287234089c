// Strata's CPU argmax over the last dimension of a float32 [rows, n] tensor, for greedy sampling.
//
// ATen's argmax reduces a vocabulary-wide row far more slowly than the CPU can compare, on every row of every
// step. This kernel finds each row's maximum a register at a time, then the first index that holds it, with
// ATen's semantics: ties go to the lowest index, and a row holding a NaN returns its first NaN (NaN compares
// greater than everything). Rows are split over ATen's threads.
//
// C++ with GCC/Clang vector types, built for this CPU by `kernels.py`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "float_tiles.h"

namespace {

using Tile = strata_kernels::NativeTile;  // one register: GCC 12 splits wider vectors' compares badly
constexpr int64_t kLanes = strata_kernels::kNativeLanes;
constexpr int64_t kStep = 4 * kLanes;  // four tiles a step, each with its own running maximum
using Mask = strata_kernels::VectorOf<kLanes, int32_t>::type;

inline Tile load(const float* p) {
  Tile v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Whether any lane is set, as one OR over the mask's 64-bit words (a lane-by-lane loop branches per lane).
inline bool any(Mask m) {
  uint64_t words[sizeof(Mask) / sizeof(uint64_t)];
  std::memcpy(words, &m, sizeof(m));
  uint64_t set = 0;
  for (const uint64_t w : words) set |= w;
  return set != 0;
}

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
  const int64_t full = n - n % kStep;
  float best = -INFINITY;
  bool nan = false;
  if (full > 0) {
    Tile top[4];
    Mask nans = {};
    for (int u = 0; u < 4; ++u) {
      top[u] = load(x + u * kLanes);
      nans |= top[u] != top[u];
    }
    for (int64_t i = kStep; i < full; i += kStep) {
      for (int u = 0; u < 4; ++u) {
        const Tile v = load(x + i + u * kLanes);
        top[u] = v > top[u] ? v : top[u];
        nans |= v != v;
      }
    }
    nan = any(nans);
    const Tile a = top[0] > top[1] ? top[0] : top[1], b = top[2] > top[3] ? top[2] : top[3];
    best = strata_kernels::lane_max(a > b ? a : b)[0];
  }
  for (int64_t i = full; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  if (nan) return first_nan(x, n);
  int64_t i = 0;
  const Tile target = Tile{} + best;
  for (; i < full; i += kStep) {
    Mask hits = {};
    for (int u = 0; u < 4; ++u) hits |= load(x + i + u * kLanes) == target;
    if (any(hits)) break;
  }
  for (; i < n; ++i)
    if (x[i] == best) return i;
  return 0;  // n == 0 is refused before; every element is -inf only if best is -inf, found above
}

// x [rows, n] float32 (a non-contiguous row stride is fine, n must be contiguous) -> [rows] int64.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "strata_cpu::argmax_rows: x must be a float32 [rows, n] tensor with n > 0, got ", x.scalar_type(),
              " ", x.sizes());
  const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t count = rows.size(0), n = rows.size(1), stride = rows.stride(0);
  at::Tensor out = at::empty({count}, rows.options().dtype(at::kLong));
  const float* data = rows.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  // A row of 16K elements or more is worth a thread of its own; shorter rows share one.
  const int64_t grain = std::max<int64_t>(1, (16384 + n - 1) / n);
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = row_argmax(data + r * stride, n);
  });
  return out;
}

}  // namespace

// A fragment: `small_batch_linear.cpp` owns the strata_cpu namespace, and either library may load first.
TORCH_LIBRARY_FRAGMENT(strata_cpu, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
