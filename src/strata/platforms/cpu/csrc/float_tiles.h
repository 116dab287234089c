// What Strata's CPU kernels share: a tile of 16 floats as a GCC/Clang vector type (one AVX-512 register, two
// AVX2 ones, four NEON ones) and the same as the CPU's own registers (`NativeTile`, `RegisterTile`); the
// loads that widen each weight or activation dtype into them; lane sums and butterflies for any width.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>  // the widening loads where the CPU has them; elsewhere plain C++ below
#endif

namespace strata_kernels {

constexpr int kLanes = 16;
// N floats as one vector type. (Through a class template: GCC ignores vector_size on an alias template
// whose size depends on its parameter.)
template <int N, typename E = float>
struct VectorOf {
  typedef E type __attribute__((vector_size(N * sizeof(E))));
};
template <int N>
using FloatVec = typename VectorOf<N>::type;
using FloatTile = FloatVec<kLanes>;

// A FloatTile as the CPU's own vector registers: one AVX-512 register, two AVX ones, four SSE or NEON ones.
// GCC 12 keeps a vector type wider than the CPU's registers in memory inside loops, so on a CPU without
// AVX-512 an accumulating FloatTile stores and reloads itself around every FMA; as native parts, with the
// loops over them unrolled, it stays in registers. With AVX-512 it is one register either way. The kernels'
// hot accumulations use this form.
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#elif defined(__AVX__)
constexpr int kNativeLanes = 8;
#else
constexpr int kNativeLanes = 4;
#endif
using NativeTile = FloatVec<kNativeLanes>;

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

// N consecutive elements of p (bfloat16, float16 or int8) widened to float in portable vector code, for
// CPUs without the x86 widening instructions. Exact for each dtype.
template <int N, typename T>
inline FloatVec<N> widen_portable(const T* p) {
  using Bits16N = typename VectorOf<N, uint16_t>::type;
  using Bits32N = typename VectorOf<N, uint32_t>::type;
  FloatVec<N> v;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // A bfloat16 is the high half of the float32 it stands for: widen the bits and shift them up.
    Bits16N h;
    std::memcpy(&h, p, sizeof(h));
    const Bits32N w = __builtin_convertvector(h, Bits32N) << 16;
    std::memcpy(&v, &w, sizeof(v));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    // float16 bits to float32 in vector integer arithmetic (c10::Half converts lane by lane): the exponent
    // and mantissa shifted into place and scaled by 2^112 (from float16's exponent bias to float32's, exact
    // for subnormals too); infinities and NaNs get float32's all-ones exponent; then the sign.
    Bits16N h;
    std::memcpy(&h, p, sizeof(h));
    const Bits32N w = __builtin_convertvector(h, Bits32N);
    const Bits32N magnitude = (w & 0x7fffu) << 13;
    FloatVec<N> scaled;
    std::memcpy(&scaled, &magnitude, sizeof(scaled));
    scaled *= 0x1p112f;
    Bits32N bits;
    std::memcpy(&bits, &scaled, sizeof(bits));
    bits = magnitude >= (0x7c00u << 13) ? (magnitude | 0x7f800000u) : bits;
    bits |= (w & 0x8000u) << 16;
    std::memcpy(&v, &bits, sizeof(v));
  } else {
    static_assert(std::is_same_v<T, int8_t>, "widen_portable widens bfloat16, float16 and int8");
    using Int8N = typename VectorOf<N, int8_t>::type;
    Int8N b;
    std::memcpy(&b, p, sizeof(b));
    v = __builtin_convertvector(b, FloatVec<N>);
  }
  return v;
}

// kNativeLanes consecutive elements of p (float, bfloat16, float16 or int8) widened to float: one register.
template <typename T>
inline NativeTile load_native(const T* p) {
  NativeTile v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));
#if defined(__AVX512F__)
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    v = reinterpret_cast<NativeTile>(_mm512_slli_epi32(h, 16));
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    v = reinterpret_cast<NativeTile>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    v = reinterpret_cast<NativeTile>(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)  // GCC 12 turns the portable form into scalar code here
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v = reinterpret_cast<NativeTile>(_mm256_slli_epi32(h, 16));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    v = reinterpret_cast<NativeTile>(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#if defined(__F16C__)
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    v = reinterpret_cast<NativeTile>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
#endif
  } else {
    v = widen_portable<kNativeLanes>(p);
  }
  return v;
}

// load_native, a float tile then kept in a register for all its uses (an empty asm that takes it in a vector
// register). Where one float tile serves several FMAs, GCC otherwise folds its load into each of them as a
// memory operand, loading the same tile once per use: decode attention's value tiles, once per query head of
// a KV head. A widened tile is computed into a register anyway.
template <typename T>
inline NativeTile load_native_once(const T* p) {
  NativeTile v = load_native(p);
  if constexpr (std::is_same_v<T, float>) {
#if defined(__x86_64__) || defined(__i386__)
    asm("" : "+v"(v));
#elif defined(__aarch64__)
    asm("" : "+w"(v));
#endif
  }
  return v;
}

// kLanes consecutive elements of p widened to float, one native register at a time (`load_native`).
template <typename T>
inline FloatTile load_tile(const T* p) {
  FloatTile v;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(&v, p, sizeof(v));  // one copy, which GCC inlines where two halves made it call out of line
  } else {
    STRATA_UNROLL
    for (int i = 0; i < kLanes / kNativeLanes; ++i) {
      const NativeTile part = load_native(p + i * kNativeLanes);
      std::memcpy(reinterpret_cast<char*>(&v) + i * sizeof(part), &part, sizeof(part));
    }
  }
  return v;
}

// `load` (of W elements) of the first n <= W elements of p, the other lanes zero; nothing past p + n is read.
template <int W, typename T, typename Load>
inline auto load_first(const T* p, int64_t n, Load load) {
  if (n == W) return load(p);
  T tmp[W] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load(static_cast<const T*>(tmp));
}

template <typename T>
inline FloatTile load_tile_n(const T* p, int64_t n) {
  return load_first<kLanes>(p, n, load_tile<T>);
}

template <typename T>
inline NativeTile load_native_n(const T* p, int64_t n) {
  return load_first<kNativeLanes>(p, n, load_native<T>);
}

// `load_tile` into registers, widened part by part.
template <typename T>
inline RegisterTile load_register_tile(const T* p) {
  RegisterTile r;
  STRATA_UNROLL
  for (int i = 0; i < RegisterTile::kParts; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&r.part[i], p + i * kNativeLanes, sizeof(NativeTile));
    } else {
      r.part[i] = load_native(p + i * kNativeLanes);
    }
  }
  return r;
}

// Lane j of the pairwise merge of W-lane tiles a (lanes 0 to W - 1) and b (W to 2W - 1) at chunk size h:
// lanes [0, W/2) take a's even (odd when `odd`) chunks of h lanes, lanes [W/2, W) take b's.
constexpr int merge_lane(int W, int h, int odd, int j) {
  const int half = W / 2, within = j % half;
  return (j < half ? 0 : W) + (2 * (within / h) + odd) * h + within % h;
}

template <int W, int H, int Odd, std::size_t... J>
inline FloatVec<W> merge_pick(FloatVec<W> a, FloatVec<W> b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, merge_lane(W, H, Odd, J)...);
}

// One level of `lane_sums`: 2H tiles of partial sums merged into H, each holding twice as many.
template <int W, int H>
inline void merge_level(FloatVec<W>* x) {
  constexpr auto lanes = std::make_index_sequence<W>();
  STRATA_UNROLL
  for (int i = 0; i < H; ++i) {
    const FloatVec<W> a = x[2 * i], b = x[2 * i + 1];
    x[i] = merge_pick<W, H, 0>(a, b, lanes) + merge_pick<W, H, 1>(a, b, lanes);
  }
  if constexpr (H > 1) merge_level<W, H / 2>(x);
}

// Lane t of the result is the sum of x[t]'s lanes, for W tiles x of W lanes (overwritten). Pairs of tiles
// are merged by adding their halves, then quarters, ...: W - 1 merges of 3 vector operations for W sums,
// where summing each tile by itself would take W dependent chains of log2(W) shuffles and adds.
// `native_lane_sums` (W = kNativeLanes) compiles to whole-register shuffles on every CPU; the FloatTile
// form (W = kLanes) is the same on AVX-512, and on AVX2 GCC 12 assembles its shuffles from scalar inserts,
// which cost the linear kernel little (one call per 16 weight rows).
template <int W>
inline FloatVec<W> lane_sums(FloatVec<W>* x) {
  merge_level<W, W / 2>(x);
  return x[0];
}

inline NativeTile native_lane_sums(NativeTile* x) { return lane_sums<kNativeLanes>(x); }

// Every lane of the result is the maximum (`lane_max`) or the sum (`lane_total`) of x's lanes: a butterfly
// of log2(W) lane swaps, where a lane-by-lane loop is a chain of W - 1 scalar operations.
template <int S, std::size_t... J>
inline NativeTile swap_lanes(NativeTile x, std::index_sequence<J...>) {
  return __builtin_shufflevector(x, x, (J ^ S)...);
}

template <int S = kNativeLanes / 2>
inline NativeTile lane_max(NativeTile x) {
  const NativeTile y = swap_lanes<S>(x, std::make_index_sequence<kNativeLanes>());
  x = x > y ? x : y;
  if constexpr (S > 1) return lane_max<S / 2>(x);
  return x;
}

template <int S = kNativeLanes / 2>
inline NativeTile lane_total(NativeTile x) {
  x += swap_lanes<S>(x, std::make_index_sequence<kNativeLanes>());
  if constexpr (S > 1) return lane_total<S / 2>(x);
  return x;
}

}  // namespace strata_kernels
