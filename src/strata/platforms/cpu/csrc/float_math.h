// Elementwise math on floats and native tiles that the kernels share, in plain arithmetic so that loops over
// it vectorise (libm's expf does not without -ffast-math): the exponential of a non-positive number (softmax
// weights) and the gated activations of GLU MLPs.
#pragma once

#include "float_tiles.h"

#include <bit>
#include <cstdint>

namespace strata_kernels {

// exp(x) for x <= 0 within 3 ulp, for a float (V = float, I = int32_t) or lane by lane for a vector of them
// (V = NativeTile, I = NativeTileInt): x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial, 2^n through the exponent bits. Adding 1.5 * 2^23 rounds x / ln2 to the integer n in the low
// mantissa bits. Below -87 (e^x < 2^-125, nothing next to a softmax's largest term, which is 1) it returns 0.
template <typename V, typename I>
inline V exp_nonpositive_as(V x) {
  constexpr float kShift = 12582912.f;
  const V lowest = V{} - 87.f;
  const V clamped = x > lowest ? x : lowest;
  const V shifted = clamped * 1.44269504f + kShift;
  const V n = shifted - kShift;
  const V r = clamped - n * 0.693145752f - n * 1.42860677e-6f;
  V p = V{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I exponent = std::bit_cast<I>(shifted) - std::bit_cast<int32_t>(kShift) + 127;
  const V e = p * std::bit_cast<V>(exponent << 23);
  return x < lowest ? V{} : e;
}

using NativeTileInt = VectorOf<kNativeLanes, int32_t>::type;
inline float exp_nonpositive(float x) { return exp_nonpositive_as<float, int32_t>(x); }
inline NativeTile exp_nonpositive(NativeTile x) { return exp_nonpositive_as<NativeTile, NativeTileInt>(x); }

// The gate activations a GLU MLP's `act(gate) * up` can take inside Strata's kernels. Both are x * sigmoid(z):
// SiLU with z = x, GELU's tanh form (0.5 x (1 + tanh(u)) = x * sigmoid(2u)) with u = sqrt(2 / pi) (x +
// 0.044715 x^3). GELU's exact (erf) form is not among them.
// kNone stands for no gate: a plain linear's outputs.
enum class GateActivation : int64_t { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// act(x) lane by lane. sigmoid(z) from e = exp(-|z|) <= 1, which cannot overflow: 1 / (1 + e) for z >= 0,
// e / (1 + e) below.
template <GateActivation A>
inline NativeTile gate_activation(NativeTile x) {
  NativeTile z = x;
  if constexpr (A == GateActivation::kGeluTanh) z = 1.5957691216f * (x + 0.044715f * x * x * x);
  const NativeTile negative_abs = z < 0 ? z : -z;
  const NativeTile e = exp_nonpositive(negative_abs);
  const NativeTile sigmoid = (z >= 0 ? NativeTile{} + 1.f : e) / (1.f + e);
  return x * sigmoid;
}

}  // namespace strata_kernels
