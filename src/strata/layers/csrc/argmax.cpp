// Strata's CPU argmax over the last dimension of a float32 [rows, n] tensor, for greedy sampling.
//
// ATen's argmax reduces a 49152-wide row at about 1.5 G elements/s (31 us; 0.9 ms a step for 32 rows), a
// tenth of what the CPU can compare. This kernel finds each row's maximum 16 lanes at a time, then the first
// index that holds it, with ATen's semantics: ties go to the lowest index, and a row holding a NaN returns
// its first NaN (NaN compares greater than everything). Rows are split over ATen's threads.
//
// C++ with GCC/Clang vector types, compiled for this CPU on first use (`cpu_kernels.py`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "float_tiles.h"

namespace {

using strata_kernels::FloatTile;
using strata_kernels::kLanes;
using Mask = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline FloatTile load(const float* p) {
  FloatTile v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline bool any(Mask m) {
  for (int i = 0; i < kLanes; ++i)
    if (m[i]) return true;
  return false;
}

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

int64_t row_argmax(const float* x, int64_t n) {
  const int64_t full = n - n % kLanes;
  float best = -INFINITY;
  bool nan = false;
  if (full > 0) {
    FloatTile top = load(x);
    Mask nans = top != top;
    for (int64_t i = kLanes; i < full; i += kLanes) {
      const FloatTile v = load(x + i);
      top = v > top ? v : top;
      nans |= v != v;
    }
    nan = any(nans);
    for (int i = 0; i < kLanes; ++i) best = top[i] > best ? top[i] : best;
  }
  for (int64_t i = full; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = x[i] > best ? x[i] : best;
  }
  if (nan) return first_nan(x, n);
  int64_t i = 0;
  const FloatTile target = FloatTile{} + best;
  for (; i < full; i += kLanes) {
    if (any(load(x + i) == target)) break;
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
