// A tensor's elements as the float32 that Strata's kernels read, and their float32 results written back in
// another dtype, without an ATen op call where a plain loop does: a decode step calls the kernels many
// times, and each `to()` is a dispatch and an allocation.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace strata_kernels {

// A float32 contiguous view of t: t itself when it already is one (no copy, no dispatch).
inline at::Tensor as_float_contiguous(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
  return t.to(at::kFloat).contiguous();
}

// t's elements as float32, valid until the calling thread's next `FloatRows`: t's own data when it is
// float32 and contiguous, a contiguous bfloat16 or float16 t widened into a buffer the thread reuses,
// anything else through `as_float_contiguous`.
class FloatRows {
 public:
  explicit FloatRows(const at::Tensor& t) {
    if (t.is_contiguous() && t.scalar_type() == at::kBFloat16) {
      data_ = widen(t.data_ptr<c10::BFloat16>(), t.numel());
    } else if (t.is_contiguous() && t.scalar_type() == at::kHalf) {
      data_ = widen(t.data_ptr<c10::Half>(), t.numel());
    } else {
      held_ = as_float_contiguous(t);
      data_ = held_.data_ptr<float>();
    }
  }
  const float* data() const { return data_; }

 private:
  template <typename T>
  static const float* widen(const T* source, int64_t n) {
    thread_local std::vector<float> widened;
    if (static_cast<int64_t>(widened.size()) < n) widened.resize(n);
    for (int64_t i = 0; i < n; ++i) widened[i] = static_cast<float>(source[i]);
    return widened.data();
  }

  at::Tensor held_;
  const float* data_;
};

// Float32 results for `out` (contiguous, of a dtype `writes`): `data()` is out's own memory when it is
// float32, else a buffer the calling thread reuses, rounded into out by `finish()`.
class FloatResults {
 public:
  static bool writes(at::ScalarType dtype) {
    return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
  }

  explicit FloatResults(at::Tensor& out) : out_(out) {
    TORCH_CHECK(writes(out.scalar_type()), "FloatResults: no float32 results for ", out.scalar_type());
    if (out.scalar_type() == at::kFloat) {
      data_ = out.data_ptr<float>();
    } else {
      thread_local std::vector<float> staged;
      if (static_cast<int64_t>(staged.size()) < out.numel()) staged.resize(out.numel());
      data_ = staged.data();
    }
  }
  float* data() const { return data_; }
  void finish() const {
    const int64_t n = out_.numel();
    if (out_.scalar_type() == at::kBFloat16) {
      c10::BFloat16* target = out_.data_ptr<c10::BFloat16>();
      for (int64_t i = 0; i < n; ++i) target[i] = static_cast<c10::BFloat16>(data_[i]);
    } else if (out_.scalar_type() == at::kHalf) {
      c10::Half* target = out_.data_ptr<c10::Half>();
      for (int64_t i = 0; i < n; ++i) target[i] = static_cast<c10::Half>(data_[i]);
    }
  }

 private:
  at::Tensor& out_;
  float* data_;
};

}  // namespace strata_kernels
