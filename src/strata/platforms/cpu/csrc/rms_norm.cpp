// Strata's CPU RMSNorm, with and without the residual add in front: one call per norm, one pass over each row.
//
// On a decode step's few short rows, ATen's `rms_norm` spends most of its time dispatching the handful of ops
// it is made of and allocating their intermediates. This kernel reads each row once (x, and the residual
// with it), writes `x + residual` while it sums the squares, then writes the normalised row from L1: what it
// costs is nearly all the op call and the output's allocation.
//
// The numbers are those of the layers' `forward_native` (`layernorm.py`): statistics in float32; Llama's
// norm (`weight_offset` false) rounds the normalised row to x's dtype before multiplying by the weight,
// which is rounded again to the product's dtype; Gemma's (`weight_offset` true) scales by `1 + weight` in
// float32 and rounds once. `x + residual` is rounded to x's dtype, like torch's add, and normalised as
// rounded.
//
// C++ with GCC/Clang vector types, compiled for this CPU (-O3 -march=native); the narrowing stores here and
// the widening loads (`float_tiles.h`) use x86 intrinsics where the CPU has them (GCC 12 turns the portable
// `__builtin_convertvector` into scalar code there), under #if with plain C++ for other CPUs. Rows are
// split over ATen's intra-op threads only for tensors large enough to pay for waking them. It is built by
// `kernels.py`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>  // the bf16 and float16 narrowing stores; elsewhere plain C++ below
#endif

namespace {

// One register per tile: GCC 12 compiles wider vector types' conversions and shuffles lane by lane.
using Tile = strata_kernels::NativeTile;
constexpr int64_t kTile = strata_kernels::kNativeLanes;
using Bits16 = strata_kernels::VectorOf<kTile, uint16_t>::type;
using Bits32 = strata_kernels::VectorOf<kTile, uint32_t>::type;
using strata_kernels::load_native;
using strata_kernels::load_native_n;

// Rows are split over threads only when each thread gets at least this many elements: below it waking a
// second thread costs more than the work it takes over. It is lower than the norm alone would call for: in a
// decode step the norm reads rows the GEMM before it just wrote on every core, and runs slower than alone.
constexpr int64_t kMinElementsPerThread = 8 * 1024;

// v rounded to the nearest-even bfloat16, as float32 bits (low half zero); NaN becomes c10's 0x7fc0.
inline Bits32 bf16_bits(Tile v) {
  Bits32 u;
  std::memcpy(&u, &v, sizeof(u));
  const Bits32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const Bits32 is_number = reinterpret_cast<Bits32>(v == v);
  return (rounded & is_number) | (0x7fc00000u & ~is_number);
}

// v rounded to T's nearest-even value (the same as c10's conversions) into kTile elements at p.
template <typename T>
inline void store(T* p, Tile v) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const Bits32 high = bf16_bits(v) >> 16;
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(high)));
#elif defined(__AVX2__)
    const __m256i h = reinterpret_cast<__m256i>(high);  // each lane <= 0xffff: the saturating pack is exact
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
#else
    const Bits16 h = __builtin_convertvector(high, Bits16);
    std::memcpy(p, &h, sizeof(h));
#endif
  } else {
#if defined(__AVX512F__)
    const __m256i h = _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
#elif defined(__F16C__) && defined(__AVX__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int j = 0; j < kTile; ++j) p[j] = static_cast<T>(v[j]);
#endif
  }
}

// v rounded to T and widened back: what `h.to(T)` leaves of it.
template <typename T>
inline Tile round_to(Tile v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const Bits32 bits = bf16_bits(v);
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  } else {
    T tmp[kTile];
    store(tmp, v);
    return load_native(tmp);
  }
}

// The first n <= kTile lanes of v into p; nothing past p + n is written.
template <typename T>
inline void store_n(T* p, Tile v, int64_t n) {
  if (n == kTile) return store(p, v);
  T tmp[kTile];
  store(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

// Rows [begin, end) of x (and residual, when given: then `sum` receives x + residual) normalised into out.
// T is x's dtype, W the weight's, O the output's: T for Gemma's norm (kOffset), the product's dtype
// (T, or float32 where W is another dtype) for Llama's.
template <typename T, typename W, typename O, bool kOffset>
void norm_rows(const T* x, const T* residual, const W* weight, T* sum, O* out, int64_t H, float eps,
               int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * H;
    // Four tiles a step, each into its own sum, so the squares do not wait on one add chain.
    Tile acc[4] = {};
    int64_t i = 0;
    if (residual != nullptr) {
      const T* rr = residual + r * H;
      T* sr = sum + r * H;
      auto add = [&](int64_t j, int64_t n, Tile& a) {
        const Tile s = round_to<T>(load_native_n(xr + j, n) + load_native_n(rr + j, n));
        store_n(sr + j, s, n);
        a += s * s;
      };
      for (; i + 4 * kTile <= H; i += 4 * kTile)
        for (int u = 0; u < 4; ++u) add(i + u * kTile, kTile, acc[u]);
      for (; i < H; i += kTile) add(i, std::min(kTile, H - i), acc[0]);
      xr = sr;
    } else {
      auto square = [&](int64_t j, int64_t n, Tile& a) {
        const Tile v = load_native_n(xr + j, n);
        a += v * v;
      };
      for (; i + 4 * kTile <= H; i += 4 * kTile)
        for (int u = 0; u < 4; ++u) square(i + u * kTile, kTile, acc[u]);
      for (; i < H; i += kTile) square(i, std::min(kTile, H - i), acc[0]);
    }
    const float sum_sq = strata_kernels::lane_total((acc[0] + acc[1]) + (acc[2] + acc[3]))[0];
    const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(H) + eps);
    O* o = out + r * H;
    for (int64_t j = 0; j < H; j += kTile) {
      const int64_t n = std::min(kTile, H - j);
      const Tile h = load_native_n(xr + j, n) * inv;
      if constexpr (kOffset) {
        store_n(o + j, h * (1.f + load_native_n(weight + j, n)), n);
      } else {
        store_n(o + j, round_to<T>(h) * load_native_n(weight + j, n), n);
      }
    }
  }
}

template <typename T, typename W, typename O, bool kOffset>
void norm_all(const T* x, const T* residual, const W* weight, T* sum, O* out, int64_t rows, int64_t H,
              float eps) {
  const int64_t grain = std::max<int64_t>(1, (kMinElementsPerThread + H - 1) / std::max<int64_t>(H, 1));
  auto run = [&](int64_t begin, int64_t end) {
    norm_rows<T, W, O, kOffset>(x, residual, weight, sum, out, H, eps, begin, end);
  };
  if (rows <= grain) {
    run(0, rows);  // one thread's worth: no parallel region at all
  } else {
    at::parallel_for(0, rows, grain, run);
  }
}

// The op's output dtype: x's for Gemma's norm, the promoted dtype of `weight * x` for Llama's.
at::ScalarType out_dtype(const at::Tensor& x, const at::Tensor& weight, bool weight_offset) {
  return weight_offset ? x.scalar_type() : c10::promoteTypes(x.scalar_type(), weight.scalar_type());
}

template <typename T, typename W>
void dispatch_out(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, at::Tensor* sum,
                  at::Tensor& out, float eps, bool weight_offset) {
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* sp = sum ? sum->data_ptr<T>() : nullptr;
  const W* wp = weight.data_ptr<W>();
  if (weight_offset) {
    norm_all<T, W, T, true>(xp, rp, wp, sp, out.data_ptr<T>(), rows, H, eps);
  } else if constexpr (std::is_same_v<T, W>) {
    norm_all<T, W, T, false>(xp, rp, wp, sp, out.data_ptr<T>(), rows, H, eps);
  } else {
    norm_all<T, W, float, false>(xp, rp, wp, sp, out.data_ptr<float>(), rows, H, eps);
  }
}

template <typename T>
void dispatch_weight(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                     at::Tensor* sum, at::Tensor& out, float eps, bool weight_offset) {
  switch (weight.scalar_type()) {
    case at::kFloat: dispatch_out<T, float>(x, residual, weight, sum, out, eps, weight_offset); break;
    case at::kBFloat16: dispatch_out<T, c10::BFloat16>(x, residual, weight, sum, out, eps, weight_offset); break;
    default: dispatch_out<T, c10::Half>(x, residual, weight, sum, out, eps, weight_offset); break;
  }
}

bool is_kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// The shared checks and the call; `residual` and `sum` are null for the plain norm.
at::Tensor norm(const char* op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                at::Tensor* sum, double eps, bool weight_offset) {
  TORCH_CHECK(x.dim() >= 1, op, "x must be [..., hidden], got a 0-d tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, "weight must be [", x.size(-1),
              "] for x of hidden size ", x.size(-1), ", got ", weight.sizes());
  TORCH_CHECK(is_kernel_dtype(x.scalar_type()), op, "x dtype must be float32, bfloat16 or float16, got ",
              x.scalar_type());
  TORCH_CHECK(is_kernel_dtype(weight.scalar_type()), op,
              "weight dtype must be float32, bfloat16 or float16, got ", weight.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, "tensors must be on the CPU");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor rc;
  if (residual != nullptr) {
    TORCH_CHECK(residual->sizes() == x.sizes(), op, "residual must have x's shape ", x.sizes(), ", got ",
                residual->sizes());
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), op, "residual must have x's dtype ",
                x.scalar_type(), ", got ", residual->scalar_type());
    rc = residual->contiguous();
    *sum = at::empty(x.sizes(), xc.options());
  }
  at::Tensor out = at::empty(x.sizes(), xc.options().dtype(out_dtype(x, weight, weight_offset)));
  const at::Tensor* r = residual ? &rc : nullptr;
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: dispatch_weight<float>(xc, r, wc, sum, out, e, weight_offset); break;
    case at::kBFloat16: dispatch_weight<c10::BFloat16>(xc, r, wc, sum, out, e, weight_offset); break;
    default: dispatch_weight<c10::Half>(xc, r, wc, sum, out, e, weight_offset); break;
  }
  return out;
}

// x [..., hidden] float32, bfloat16 or float16, normalised over its last dimension (any leading shape: a
// layer passes its input as it comes, so the compiler's `rms_norm(a + b)` pattern sees the add itself);
// weight [hidden] in one of those dtypes. Returns the normalised x, in x's shape: in x's dtype with
// weight_offset (Gemma), else in the dtype of `weight * x` (Llama).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_offset) {
  return norm("strata_cpu::rms_norm: ", x, nullptr, weight, nullptr, eps, weight_offset);
}

// As rms_norm, of s = x + residual (residual: x's shape and dtype; s rounded to x's dtype); returns
// (rms_norm(s), s) as new tensors, the inputs untouched.
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps, bool weight_offset) {
  at::Tensor sum;
  at::Tensor out = norm("strata_cpu::fused_add_rms_norm: ", x, &residual, weight, &sum, eps, weight_offset);
  return {out, sum};
}

}  // namespace

// A fragment: `small_batch_linear.cpp` owns the strata_cpu namespace, and either library may load first.
TORCH_LIBRARY_FRAGMENT(strata_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool weight_offset) -> Tensor");
  m.def(
      "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool weight_offset) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
}
