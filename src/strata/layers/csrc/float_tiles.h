// What Strata's CPU kernels share: a register tile of 16 floats as a GCC/Clang vector type (one AVX-512
// register, two AVX2 ones, four NEON ones), the loads that widen 16 elements of each weight or activation
// dtype into one, and the horizontal sums of 16 such tiles at once.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>  // the widening loads where the CPU has them; elsewhere plain C++ below
#endif

namespace strata_kernels {

constexpr int kLanes = 16;
using FloatTile = float __attribute__((vector_size(kLanes * sizeof(float))));
using Bits16 = uint16_t __attribute__((vector_size(kLanes * sizeof(uint16_t))));
using Bits32 = uint32_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// A FloatTile as the CPU's own vector registers: one AVX-512 register, two AVX ones, four SSE or NEON ones.
// GCC (12, measured) keeps a vector type wider than the CPU's registers in memory inside loops, so on a CPU
// without AVX-512 an accumulating FloatTile stores and reloads itself around every FMA; as native parts,
// with the loops over them unrolled, it stays in registers. On one core of an AVX2-only Zen 3 EPYC,
// SmolLM-135M's decode linears through `strata_cpu::linear` went from 48 to 38 ms. With AVX-512 it is one
// register either way. The kernels' hot accumulations use this form.
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#elif defined(__AVX__)
constexpr int kNativeLanes = 8;
#else
constexpr int kNativeLanes = 4;
#endif
using NativeTile = float __attribute__((vector_size(kNativeLanes * sizeof(float))));

// Before a loop over RegisterTiles: unrolled, GCC keeps them in registers; as a loop, in memory.
#define STRATA_UNROLL _Pragma("GCC unroll 16")

struct RegisterTile {
  static constexpr int kParts = kLanes / kNativeLanes;
  NativeTile part[kParts];

  RegisterTile& operator+=(const RegisterTile& other) {
    STRATA_UNROLL
    for (int i = 0; i < kParts; ++i) part[i] += other.part[i];
    return *this;
  }
  friend RegisterTile operator*(const RegisterTile& a, const RegisterTile& b) {
    RegisterTile product;
    STRATA_UNROLL
    for (int i = 0; i < kParts; ++i) product.part[i] = a.part[i] * b.part[i];
    return product;
  }
};

inline RegisterTile to_registers(const FloatTile& v) {
  RegisterTile r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

inline FloatTile from_registers(const RegisterTile& r) {
  FloatTile v;
  std::memcpy(&v, &r, sizeof(v));
  return v;
}

// kLanes consecutive elements of p (float, bfloat16, float16 or int8) widened to float; exact for each.
template <typename T>
inline FloatTile load_tile(const T* p) {
  FloatTile v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // A bfloat16 is the high half of the float32 it stands for: widen the bits and shift them up.
#if defined(__AVX512F__)
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    v = reinterpret_cast<FloatTile>(_mm512_slli_epi32(h, 16));
#elif defined(__AVX2__)  // GCC 12 turns the portable form below into scalar code here
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16);
    const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16);
    std::memcpy(&v, &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#else
    Bits16 h;
    std::memcpy(&h, p, sizeof(h));
    const Bits32 w = __builtin_convertvector(h, Bits32) << 16;
    std::memcpy(&v, &w, sizeof(v));
#endif
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(__AVX512F__)
    v = reinterpret_cast<FloatTile>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(q)), hi = _mm256_cvtph_ps(_mm_loadu_si128(q + 1));
    std::memcpy(&v, &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#else
    // float16 bits to float32 in vector integer arithmetic (c10::Half converts lane by lane): the exponent
    // and mantissa shifted into place and scaled by 2^112 (from float16's exponent bias to float32's, exact
    // for subnormals too); infinities and NaNs get float32's all-ones exponent; then the sign.
    Bits16 h;
    std::memcpy(&h, p, sizeof(h));
    const Bits32 w = __builtin_convertvector(h, Bits32);
    const Bits32 magnitude = (w & 0x7fffu) << 13;
    FloatTile scaled;
    std::memcpy(&scaled, &magnitude, sizeof(scaled));
    scaled *= 0x1p112f;
    Bits32 bits;
    std::memcpy(&bits, &scaled, sizeof(bits));
    bits = magnitude >= (0x7c00u << 13) ? (magnitude | 0x7f800000u) : bits;
    bits |= (w & 0x8000u) << 16;
    std::memcpy(&v, &bits, sizeof(v));
#endif
  } else {
    static_assert(std::is_same_v<T, int8_t>, "load_tile widens float, bfloat16, float16 and int8");
#if defined(__AVX512F__)
    v = reinterpret_cast<FloatTile>(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b)));
    std::memcpy(&v, &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#else
    for (int j = 0; j < kLanes; ++j) v[j] = static_cast<float>(p[j]);
#endif
  }
  return v;
}

// The first n <= kLanes elements, the other lanes zero; nothing past p + n is read.
template <typename T>
inline FloatTile load_tile_n(const T* p, int64_t n) {
  if (n == kLanes) return load_tile(p);
  T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load_tile(tmp);
}

// `load_tile` into registers: float32 read part by part, other dtypes widened as a FloatTile first.
template <typename T>
inline RegisterTile load_register_tile(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    RegisterTile r;
    STRATA_UNROLL
    for (int i = 0; i < RegisterTile::kParts; ++i) {
      std::memcpy(&r.part[i], p + i * kNativeLanes, sizeof(NativeTile));
    }
    return r;
  } else {
    return to_registers(load_tile(p));
  }
}

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
