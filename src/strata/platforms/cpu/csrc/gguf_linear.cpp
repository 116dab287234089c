// Strata's CPU linear and embedding on GGUF (ggml) quantized weights, computed on the blocks as the file
// stores them: out = x @ dequant(qweight).T (+ bias), and the dequantized rows of an embedding table.
//
// A GGUF weight row (one output channel) is its K input weights as consecutive ggml blocks: 32 weights with
// a float16 scale (and a minimum or a fifth bit) in the legacy types Q4_0 ... Q8_0; 256 weights in 8 or 16
// sub-blocks with small integer scales under float16 ones in the K-quants Q2_K ... Q6_K; plain float16,
// bfloat16 or float32 otherwise. The bytes are read where they lie, often a read-only memory map of the
// file, and never written.
//
// Decode (1 to kMaxDecodeRows rows of x) is bound by reading the weights, so each weight row is streamed once
// and its blocks decoded in registers. On x86 with AVX2 x is first quantized to int8 (per 32 inputs for the
// legacy types, per 256 for the K-quants, as llama.cpp's q8_0 / q8_K are), so that a block's small integer
// weights meet it in integer dot products (`dot_u8s8`: AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw) and only
// each block's (or sub-block's) sum is scaled in float. Widening the weights to float for float FMAs instead
// (the float path below) ran 2.5-4.5x slower on Zen 4 (Q4_0, Q8_0, Q4_K, Q6_K at one row of x). For 8- and
// 6-bit weights x is kept finer (`kResidual`): in int16 for Q8_0, with what int8 leaves over (to 1/128 of a
// step) for Q6_K. Offsets (Q4_0's -8 ...) and minimums are taken out with precomputed per-16 or per-32 sums of
// x, so that the weights' unsigned codes enter the dot products as they are. F16/BF16/F32 rows are widened and
// multiplied in float, as every type is on CPUs without AVX2. The weight rows are split over ATen's threads,
// only for layers big enough to pay for waking a second one, and every output comes out the same whatever the
// thread count.
//
// More rows of x (batches, prefill) take the batch path on the quantized types: each thread repacks 8 weight
// rows at a time so that one broadcast of x's integers meets all 8 in a dot product, each output in a lane of
// its own (x in int16). F16/BF16/F32 weights, and every type without AVX2, amortise a float dequantization
// over the rows instead: each thread dequantizes panels of its weight rows into a float32 scratch that stays
// in its L2 cache and multiplies x by each with ATen's GEMM (one thread each), straight into the output's
// columns.
//
// The x86 kernels use 256-bit vectors, which 32 weights (a legacy block, a K-quant sub-block) fill: with
// AVX-512 they take its VNNI dot products and masked byte moves in their 256-bit (AVX512-VL) forms, and
// widen to float 16 lanes at a time; Zen 4 runs a 512-bit operation as two 256-bit halves, so wider
// vectors would not multiply faster there. Plain C++ (the float path) serves other CPUs. Built by
// `kernels.py`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_rows.h"
#include "float_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

// The x86 kernels below need AVX2 with FMA and F16C (every AVX2 CPU has them; AVX-512 ones add to them).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define STRATA_GGUF_AVX2 1
#else
#define STRATA_GGUF_AVX2 0
#endif

namespace {

using strata_kernels::kLanes;
using strata_kernels::load_register_tile;
using strata_kernels::load_tile_n;
using strata_kernels::to_registers;
using Tile = strata_kernels::RegisterTile;

// ggml's type numbers (`gguf.GGMLQuantizationType`) for the types computed here.
constexpr int64_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10,
                  kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30;

// Weights per block and bytes per block of each type (ggml's `ggml_type_traits`).
template <int64_t Q>
struct Layout;
template <> struct Layout<kF32> { static constexpr int64_t kElems = 1, kBytes = 4; };
template <> struct Layout<kF16> { static constexpr int64_t kElems = 1, kBytes = 2; };
template <> struct Layout<kBF16> { static constexpr int64_t kElems = 1, kBytes = 2; };
template <> struct Layout<kQ4_0> { static constexpr int64_t kElems = 32, kBytes = 18; };
template <> struct Layout<kQ4_1> { static constexpr int64_t kElems = 32, kBytes = 20; };
template <> struct Layout<kQ5_0> { static constexpr int64_t kElems = 32, kBytes = 22; };
template <> struct Layout<kQ5_1> { static constexpr int64_t kElems = 32, kBytes = 24; };
template <> struct Layout<kQ8_0> { static constexpr int64_t kElems = 32, kBytes = 34; };
template <> struct Layout<kQ2_K> { static constexpr int64_t kElems = 256, kBytes = 84; };
template <> struct Layout<kQ3_K> { static constexpr int64_t kElems = 256, kBytes = 110; };
template <> struct Layout<kQ4_K> { static constexpr int64_t kElems = 256, kBytes = 144; };
template <> struct Layout<kQ5_K> { static constexpr int64_t kElems = 256, kBytes = 176; };
template <> struct Layout<kQ6_K> { static constexpr int64_t kElems = 256, kBytes = 210; };

template <int64_t Q>
using TypeTag = std::integral_constant<int64_t, Q>;

// f(TypeTag<qtype>{}) for a supported qtype; an error naming `op` for any other.
template <typename F>
decltype(auto) with_qtype(int64_t qtype, const char* op, F&& f) {
  switch (qtype) {
    case kF32: return f(TypeTag<kF32>{});
    case kF16: return f(TypeTag<kF16>{});
    case kBF16: return f(TypeTag<kBF16>{});
    case kQ4_0: return f(TypeTag<kQ4_0>{});
    case kQ4_1: return f(TypeTag<kQ4_1>{});
    case kQ5_0: return f(TypeTag<kQ5_0>{});
    case kQ5_1: return f(TypeTag<kQ5_1>{});
    case kQ8_0: return f(TypeTag<kQ8_0>{});
    case kQ2_K: return f(TypeTag<kQ2_K>{});
    case kQ3_K: return f(TypeTag<kQ3_K>{});
    case kQ4_K: return f(TypeTag<kQ4_K>{});
    case kQ5_K: return f(TypeTag<kQ5_K>{});
    case kQ6_K: return f(TypeTag<kQ6_K>{});
    default: break;
  }
  TORCH_CHECK(false, "strata_cpu::", op, ": unsupported GGUF type ", qtype,
              " (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)");
}

// (weights, bytes) per block of a supported qtype.
std::pair<int64_t, int64_t> block_layout(int64_t qtype, const char* op) {
  return with_qtype(qtype, op, [](auto tag) {
    using L = Layout<decltype(tag)::value>;
    return std::pair<int64_t, int64_t>{L::kElems, L::kBytes};
  });
}

// The little-endian float16 at p (blocks are byte-aligned: no wider alignment can be assumed anywhere).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------------------------------------------------
// Dequantization in plain C++, one block at a time, in ggml's reference order of operations (one float
// multiply, then the minimum subtracted or added): on CPUs without AVX2 it serves the embedding, the wide
// path's panels and the float decode path (`dequant_span`). The layouts, byte by byte, are spelled out here.

// The 6-bit scales and minimums of a Q4_K/Q5_K super-block's 8 sub-blocks, from their 12 packed bytes:
// bytes 0-3 hold the low 6 bits of scales 0-3 (their top 2 bits: scales 4-7's high bits), bytes 4-7 the
// same for the minimums, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and minimums 4-7 (high).
// Four at a time in 32-bit words.
inline void k4_scales(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  const uint32_t lo = u32_at(packed), mid = u32_at(packed + 4), hi = u32_at(packed + 8);
  const uint32_t words[4] = {lo & 0x3f3f3f3fu, (hi & 0x0f0f0f0fu) | ((lo >> 2) & 0x30303030u),
                             mid & 0x3f3f3f3fu, ((hi >> 4) & 0x0f0f0f0fu) | ((mid >> 2) & 0x30303030u)};
  std::memcpy(scales, words, 8);
  std::memcpy(mins, words + 2, 8);
}

// The 16 signed 6-bit scales of a Q3_K super-block from their 12 packed bytes: bytes 0-7 hold the low 4
// bits (scales 0-7 in the low nibbles, 8-15 in the high ones), bytes 8-11 the high 2 bits, scale i's in
// byte 8 + i % 4 at bit 2 * (i / 4); stored with 32 added.
inline void k3_scales(const uint8_t* packed, int8_t* scales) {
  const uint32_t a = u32_at(packed), b = u32_at(packed + 4), h = u32_at(packed + 8);
  const uint32_t words[4] = {(a & 0x0f0f0f0fu) | ((h & 0x03030303u) << 4),
                             (b & 0x0f0f0f0fu) | (((h >> 2) & 0x03030303u) << 4),
                             ((a >> 4) & 0x0f0f0f0fu) | (((h >> 4) & 0x03030303u) << 4),
                             ((b >> 4) & 0x0f0f0f0fu) | (((h >> 6) & 0x03030303u) << 4)};
  uint8_t bytes[16];
  std::memcpy(bytes, words, 16);
  for (int i = 0; i < 16; ++i) scales[i] = static_cast<int8_t>(bytes[i] - 32);
}

template <int64_t Q>
inline void dequant_block(const uint8_t* b, float* y) {
  if constexpr (Q == kQ4_0 || Q == kQ4_1) {
    // Low nibbles are weights 0-15, high nibbles 16-31.
    const float d = half_at(b);
    const uint8_t* qs = b + (Q == kQ4_0 ? 2 : 4);
    if constexpr (Q == kQ4_0) {
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>((qs[j] & 15) - 8);
        y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      }
    } else {
      const float m = half_at(b + 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>(qs[j] & 15) + m;
        y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    }
  } else if constexpr (Q == kQ5_0 || Q == kQ5_1) {
    // Nibbles as Q4_0's; bit j of the 32-bit qh is weight j's fifth bit.
    const float d = half_at(b);
    const int off = Q == kQ5_0 ? 2 : 4;
    const uint32_t qh = u32_at(b + off);
    const uint8_t* qs = b + off + 4;
    int q[32];
    for (int j = 0; j < 16; ++j) {
      q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
      q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
    if constexpr (Q == kQ5_0) {
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j] - 16);
    } else {
      const float m = half_at(b + 2);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(q[j]) + m;
    }
  } else if constexpr (Q == kQ8_0) {
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(qs[j]);
  } else if constexpr (Q == kQ2_K) {
    // scales[16] (per 16 weights: scale in the low nibble, minimum in the high), qs[64], d, dmin. Weight
    // 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l].
    const uint8_t* sc = b;
    const uint8_t* qs = b + 16;
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        for (int half = 0; half < 2; ++half) {
          const int g = 8 * h + 2 * s + half;
          const float dl = d * static_cast<float>(sc[g] & 15), ml = dmin * static_cast<float>(sc[g] >> 4);
          float* out = y + 16 * g;
          const uint8_t* q = qs + 32 * h + 16 * half;
          for (int l = 0; l < 16; ++l) out[l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
        }
      }
    }
  } else if constexpr (Q == kQ3_K) {
    // hmask[32], qs[64], scales[12], d. Weight 128 h + 32 s + l: low 2 bits as Q2_K's, high bit j = 4h + s
    // of hmask[l], set meaning no offset and clear -4; signed 6-bit scales per 16 weights.
    const uint8_t* hm = b;
    const uint8_t* qs = b + 32;
    int8_t scales[16];
    k3_scales(b + 96, scales);
    const float d = half_at(b + 108);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        const int j = 4 * h + s;
        for (int half = 0; half < 2; ++half) {
          const int g = 2 * j + half;
          const float dl = d * static_cast<float>(scales[g]);
          float* out = y + 16 * g;
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hm[l] >> j) & 1) ? 0 : 4);
            out[l - 16 * half] = dl * static_cast<float>(q);
          }
        }
      }
    }
  } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
    // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]. Byte l of the 32-byte chunk c holds weight 64c + l in
    // its low nibble and 64c + 32 + l in its high one; Q5_K's fifth bit of sub-block j's weight l is bit j
    // of qh[l].
    const float d = half_at(b), dmin = half_at(b + 2);
    uint8_t sc[8], mn[8];
    k4_scales(b + 4, sc, mn);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (Q == kQ4_K ? 16 : 48);
    for (int j = 0; j < 8; ++j) {
      const float dl = d * static_cast<float>(sc[j]), ml = dmin * static_cast<float>(mn[j]);
      const uint8_t* q = qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      float* out = y + 32 * j;
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 15;
        if constexpr (Q == kQ5_K) v |= ((qh[l] >> j) & 1) << 4;
        out[l] = dl * static_cast<float>(v) - ml;
      }
    }
  } else if constexpr (Q == kQ6_K) {
    // ql[128], qh[64], scales[16] (int8, per 16 weights), d. Weight 128 h + 32 s + l: low 4 bits from
    // ql[64 h + 32 (s % 2) + l] (low nibble for s < 2, high nibble after), high 2 bits at bit 2s of
    // qh[32 h + l]; offset -32.
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        const uint8_t* lo = ql + 64 * h + 32 * (s % 2);
        const int shift = 4 * (s / 2);
        for (int half = 0; half < 2; ++half) {
          const int g = 8 * h + 2 * s + half;
          const float dl = d * static_cast<float>(scales[g]);
          float* out = y + 16 * g;
          for (int l = 16 * half; l < 16 * half + 16; ++l) {
            const int q = (((lo[l] >> shift) & 15) | (((qh[32 * h + l] >> (2 * s)) & 3) << 4)) - 32;
            out[l - 16 * half] = dl * static_cast<float>(q);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// x quantized to int8 for the int8 decode path.

// x quantized per `block` inputs (32 or 256), with the sums the weights' offsets and minimums need; for
// Q6_K also what int8 leaves over, in 128ths of a step (Q8_0 takes x in int16 instead). Row m's data starts
// at q + m * K (and r, q16 + m * K), d + m * (K / block), and each per-16/per-32 array at m * (K / 16) or
// m * (K / 32).
struct QuantizedX {
  int64_t K = 0, block = 0;
  const int8_t* q = nullptr;
  const int8_t* r = nullptr;      // with a residual: x ~ d * (q + r / 128), r in [-64, 64]
  const int16_t* q16 = nullptr;   // Q8_0's x in int16 instead (`quantize_batch`): x ~ d * q16
  const float* d = nullptr;       // each block's scale: x ~ d * q
  const float* sum16 = nullptr;   // exact sums of x over each 16 inputs (for minimums)
  const float* qsum16 = nullptr;  // d * (sum of q + r / 128) over each 16 inputs (for offsets: they meet q)
  const float* sum32 = nullptr;
  const float* qsum32 = nullptr;
};

// Whether x is kept finer than int8 for weights of type Q: for 8- and 6-bit weights, the types files keep
// their output layer in. x in int8 errs by up to 1/254 of its block's largest |x| (of 256 for the K-quants),
// as much as a Q8_0 weight errs by and more than a Q6_K one where one input stands out (a hidden state of
// SmolLM2 has one 17x its RMS): through the Q8_0 output layer of SmolLM2-135M it moved a token's logprob by
// 0.07, against 0.001 kept finer. Q8_0 takes x in int16 (its weights widened to int16 in registers, two
// vpdpwssd a block, both operands signed), which was faster than int8 alone with vpdpbusd's sign tricks;
// Q6_K decode keeps int8 and what it leaves over (a residual, to 1/128 of a step: a second dot product per
// sub-block, 20-30% slower at one row of cached weights), since its per-16 scales apply in 16-bit pair sums
// that int16 x would overflow. The batch path takes both in int16. For 2- to 5-bit weights x's int8 error
// stays below the weights' own, and they go without, as llama.cpp's do.
template <int64_t Q>
constexpr bool kResidual = Q == kQ8_0 || Q == kQ6_K;

// ---------------------------------------------------------------------------------------------------------
// x86 (AVX2 and up): each type's blocks decoded in 256-bit registers, 32 weights at a time, as unsigned
// codes in order (Q8_0: its signed bytes) plus what scales them. The int8 decode path multiplies the codes
// by x's int8 values; the SIMD dequantization widens them to float.

#if STRATA_GGUF_AVX2

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// acc + the sums of each 4 adjacent products u[i] * s[i] (unsigned by signed bytes), per 32-bit lane.
// Without VNNI, vpmaddubsw's 16-bit pair sums saturate at 32767: every caller keeps u * |s| * 2 below that
// (u < 128, or u <= 128 with |s| <= 127).
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// acc + the sums of each 2 adjacent products a[i] * b[i] of signed 16-bit values, per 32-bit lane (exact
// unless both pairs are -32768 * -32768, which no caller has).
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// acc + the products u[i] * s[i] summed in pairs (16-bit, below saturation: u < 64 here) and each pair's
// sum times its 16-bit lane of `scales`, summed per 32-bit lane: a sub-block's integer dot product with its
// scale (or two 16-weight groups' with theirs) applied before leaving integers.
inline __m256i dot_u8s8_scaled(__m256i acc, __m256i u, __m256i s, __m256i scales) {
  return dot_s16(acc, _mm256_maddubs_epi16(u, s), scales);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// The largest |x| of n (a multiple of 8) floats.
inline float abs_max(const float* x, int64_t n) {
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(x + i)));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

// 32 int32 values within int8's range (4 vectors) as 32 bytes in order: the packs interleave by 4, the
// permute restores the order.
inline __m256i pack_bytes(const __m256i* w) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// x [M, K] quantized into buffers the calling thread reuses (valid until its next call): per block of
// `block` inputs, d = max |x| / 127 and q = round(x / d) in [-127, 127] (never -128, so that q can be
// negated in a byte); with `residual`, r = round((x / d - q) * 128) too. The sums of the quantized x
// (qsum16, qsum32) include r / 128.
QuantizedX quantize_x(const float* x, int64_t M, int64_t K, int64_t block, bool residual) {
  thread_local std::vector<int8_t> qbuf;
  thread_local std::vector<float> fbuf;
  const int64_t nb = K / block, n16 = K / 16, n32 = K / 32;
  const int64_t bytes = (residual ? 2 : 1) * M * K;
  if (static_cast<int64_t>(qbuf.size()) < bytes) qbuf.resize(bytes);
  const int64_t floats = M * (nb + 2 * n16 + 2 * n32);
  if (static_cast<int64_t>(fbuf.size()) < floats) fbuf.resize(floats);
  QuantizedX r;
  r.K = K;
  r.block = block;
  float* d = fbuf.data();
  float* sum16 = d + M * nb;
  float* qsum16 = sum16 + M * n16;
  float* sum32 = qsum16 + M * n16;
  float* qsum32 = sum32 + M * n32;
  r.q = qbuf.data();
  r.r = residual ? qbuf.data() + M * K : nullptr;
  r.d = d;
  r.sum16 = sum16;
  r.qsum16 = qsum16;
  r.sum32 = sum32;
  r.qsum32 = qsum32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * block;
      int8_t* qb = qbuf.data() + m * K + b * block;
      int8_t* rb = residual ? qbuf.data() + M * K + m * K + b * block : nullptr;
      float* s16 = sum16 + m * n16 + b * (block / 16);
      float* q16 = qsum16 + m * n16 + b * (block / 16);
      // In 8-float vectors: q (and r) rounded (to nearest even) and packed to bytes; each 16's sums by
      // horizontal adds.
      const float amax = abs_max(xb, block);
      const float scale = amax / 127.f;
      d[m * nb + b] = scale;
      const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      for (int64_t i = 0; i < block; i += 32) {
        __m256 v[4];
        __m256i q[4], rest[4];
        for (int k = 0; k < 4; ++k) {
          v[k] = _mm256_loadu_ps(xb + i + 8 * k);
          const __m256 steps = _mm256_mul_ps(v[k], inverse);
          q[k] = _mm256_cvtps_epi32(steps);
          if (residual) {
            rest[k] = _mm256_cvtps_epi32(
                _mm256_mul_ps(_mm256_sub_ps(steps, _mm256_cvtepi32_ps(q[k])), _mm256_set1_ps(128.f)));
          }
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), pack_bytes(q));
        if (residual) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(rb + i), pack_bytes(rest));
          for (int k = 0; k < 4; ++k) q[k] = _mm256_add_epi32(_mm256_slli_epi32(q[k], 7), rest[k]);  // in 128ths
        } else {
          for (int k = 0; k < 4; ++k) q[k] = _mm256_slli_epi32(q[k], 7);
        }
        const __m256 f = _mm256_hadd_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
        const __m128 f2 = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        const __m256i n = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        const __m128i n2 = _mm_add_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
        const __m128 fs = _mm_hadd_ps(f2, f2);
        const __m128 ns = _mm_mul_ps(_mm_cvtepi32_ps(_mm_hadd_epi32(n2, n2)), _mm_set1_ps(scale / 128.f));
        s16[i / 16] = _mm_cvtss_f32(fs);
        s16[i / 16 + 1] = _mm_cvtss_f32(_mm_movehdup_ps(fs));
        q16[i / 16] = _mm_cvtss_f32(ns);
        q16[i / 16 + 1] = _mm_cvtss_f32(_mm_movehdup_ps(ns));
      }
    }
    for (int64_t g = 0; g < n32; ++g) {
      sum32[m * n32 + g] = sum16[m * n16 + 2 * g] + sum16[m * n16 + 2 * g + 1];
      qsum32[m * n32 + g] = qsum16[m * n16 + 2 * g] + qsum16[m * n16 + 2 * g + 1];
    }
  }
  return r;
}

// x in int16 per 32 inputs: a scale d and q = round(x / d), d = max |x| / 32512 (127 * 256: x that int8 with
// a residual holds exactly stays exact); per group of G inputs, -offset times the sum of q (the codes'
// offset, which meets q) and the exact sum of x (for minimums). x errs by at most 1/65024 of its block's
// largest |x|, as finely as decode's residual.
struct BatchX {
  const int16_t* q = nullptr;     // row m at q + m * K
  const float* d = nullptr;       // [M, K / 32]
  const int32_t* init = nullptr;  // [M, K / G]
  const float* sum = nullptr;     // [M, K / G]
};

template <int G>
BatchX quantize_batch(const float* x, int64_t M, int64_t K, int offset) {
  thread_local std::vector<int16_t> qbuf;
  thread_local std::vector<float> fbuf;
  thread_local std::vector<int32_t> ibuf;
  const int64_t blocks = M * K / 32, groups = M * K / G;  // rows are whole blocks: x's blocks end to end
  if (static_cast<int64_t>(qbuf.size()) < M * K) qbuf.resize(M * K);
  if (static_cast<int64_t>(fbuf.size()) < blocks + groups) fbuf.resize(blocks + groups);
  if (static_cast<int64_t>(ibuf.size()) < groups) ibuf.resize(groups);
  float* sum = fbuf.data() + blocks;
  constexpr float kMax = 127.f * 256;
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + 32 * i;
    const float amax = abs_max(xb, 32);
    fbuf[i] = amax / kMax;
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? kMax / amax : 0.f);
    __m256 v[4];
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(xb + 8 * k);
      q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inverse));
    }
    // The pack interleaves by 4 within 128-bit lanes; the permute restores the order.
    __m256i* out = reinterpret_cast<__m256i*>(qbuf.data() + 32 * i);
    _mm256_storeu_si256(out, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
    _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8));
    for (int g = 0; g < 32 / G; ++g) {
      const int k = 4 / (32 / G) * g, n = 4 / (32 / G);  // this group's vectors
      __m256i qs = q[k];
      __m256 vs = v[k];
      for (int j = 1; j < n; ++j) qs = _mm256_add_epi32(qs, q[k + j]), vs = _mm256_add_ps(vs, v[k + j]);
      ibuf[i * (32 / G) + g] = -offset * hsum(qs);
      sum[i * (32 / G) + g] = hsum(vs);
    }
  }
  return {qbuf.data(), fbuf.data(), ibuf.data(), sum};
}

// The first g <= 8 floats at p, the other lanes zero (nothing past p + g is read).
inline __m256 load_floats(const float* p, int g) {
  if (g == 8) return _mm256_loadu_ps(p);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(g), lane));
}

// The float16 at p + j * stride for j < g <= 8, as 8 floats (zero past g): gathered in integer registers,
// one conversion for all of them, where converting each block's on its own costs three vector operations.
// (The words go into the vector register by vmovq/vpinsrq: stored and loaded as one 16-byte value, they
// stall the load on store forwarding.)
inline __m256 halves(const uint8_t* p, int64_t stride, int g) {
  uint64_t word[2] = {0, 0};
  const auto gather = [&](int j) {
    uint16_t h;
    std::memcpy(&h, p + j * stride, 2);
    word[j / 4] |= static_cast<uint64_t>(h) << (16 * (j % 4));
  };
  if (g == 8) {
    STRATA_UNROLL
    for (int j = 0; j < 8; ++j) gather(j);
  } else {
    for (int j = 0; j < g; ++j) gather(j);
  }
  const __m128i h =
      _mm_insert_epi64(_mm_cvtsi64_si128(static_cast<int64_t>(word[0])), static_cast<int64_t>(word[1]), 1);
  return _mm256_cvtph_ps(h);
}

// Bit J of each byte of v moved to bit P (every other bit clear): one 16-bit shift and a mask. The shift
// pulls bits across the byte boundary, but only into positions the mask clears.
template <int J, int P>
inline __m256i bit_to(__m256i v) {
  if constexpr (P > J) v = _mm256_slli_epi16(v, P - J);
  if constexpr (J > P) v = _mm256_srli_epi16(v, J - P);
  return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(1 << P)));
}

// Bits N..N+W-1 of each byte of v, as the byte's value.
template <int N, int W>
inline __m256i bits_of(__m256i v) {
  if constexpr (N > 0) v = _mm256_srli_epi16(v, N);
  return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>((1 << W) - 1)));
}

// A legacy block's 16 bytes of nibbles as its 32 weights in order: the low nibbles (weights 0-15) in the
// low 128-bit lane, the high ones (16-31) in the high lane. The bytes are loaded into both lanes at once
// and the high lane shifted by its own count.
inline __m256i nibbles(const uint8_t* qs) {
  const __m256i q = _mm256_broadcastsi128_si256(load16(qs));
  return _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

// 0x10 in byte j where bit j of qh is set, else 0: Q5's fifth bits, in place.
inline __m256i fifth_bits(uint32_t qh) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(_cvtu32_mask32(qh), _mm256_set1_epi8(0x10));
#else
  // Byte j takes qh's byte j / 8 (a shuffle within each 128-bit lane of the broadcast word), then tests
  // its bit j % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(qh)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#endif
}

// The legacy types: a block's weight i is d * codes[i] - kOffset * d, or d * codes[i] + m where the block
// has a minimum m (the float16 after d); Q8_0's codes are its signed bytes.
template <int64_t Q>
struct Legacy;
template <>
struct Legacy<kQ4_0> {
  static constexpr int kOffset = 8;
  static constexpr bool kMin = false;
  static __m256i codes(const uint8_t* b) { return nibbles(b + 2); }
};
template <>
struct Legacy<kQ4_1> {
  static constexpr int kOffset = 0;
  static constexpr bool kMin = true;
  static __m256i codes(const uint8_t* b) { return nibbles(b + 4); }
};
template <>
struct Legacy<kQ5_0> {
  static constexpr int kOffset = 16;
  static constexpr bool kMin = false;
  static __m256i codes(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 6), fifth_bits(u32_at(b + 2))); }
};
template <>
struct Legacy<kQ5_1> {
  static constexpr int kOffset = 0;
  static constexpr bool kMin = true;
  static __m256i codes(const uint8_t* b) { return _mm256_or_si256(nibbles(b + 8), fifth_bits(u32_at(b + 4))); }
};
template <>
struct Legacy<kQ8_0> {
  static constexpr int kOffset = 0;
  static constexpr bool kMin = false;
  static __m256i codes(const uint8_t* b) { return load32(b + 2); }
};

// Per-16 scales (16 bytes, signed or not) as the 16-bit pair multipliers of sub-block j's 32 weights:
// weights 0-15 (the low 128-bit lane's pairs) take scale 2j, 16-31 take scale 2j + 1. `lo` and `hi`
// hold scales 0-7 and 8-15 widened to 16 bits in both 128-bit lanes.
struct Scales16 {
  __m256i lo, hi;
  template <bool Signed>
  static Scales16 from(__m128i b) {
    const __m256i w = Signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
    return {_mm256_permute4x64_epi64(w, 0x44), _mm256_permute4x64_epi64(w, 0xEE)};
  }
  template <int J>
  __m256i of() const {
    constexpr int i = 4 * (J % 4);  // byte offset of scale 2 (J % 4) within a lane of 8 scales
    const __m256i pick = _mm256_setr_epi8(i, i + 1, i, i + 1, i, i + 1, i, i + 1, i, i + 1, i, i + 1, i, i + 1,
                                          i, i + 1, i + 2, i + 3, i + 2, i + 3, i + 2, i + 3, i + 2, i + 3, i + 2,
                                          i + 3, i + 2, i + 3, i + 2, i + 3, i + 2, i + 3);
    return _mm256_shuffle_epi8(J < 4 ? lo : hi, pick);
  }
};

// 16 bytes (signed or not) as two vectors of 8 floats, each times f.
template <bool Signed>
inline void widen16(__m128i b, float f, __m256& lo, __m256& hi) {
  const __m256 s = _mm256_set1_ps(f);
  const auto widen = [](__m128i v) { return Signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v); };
  lo = _mm256_mul_ps(_mm256_cvtepi32_ps(widen(b)), s);
  hi = _mm256_mul_ps(_mm256_cvtepi32_ps(widen(_mm_srli_si128(b, 8))), s);
}

// The K-quants. Each decodes a super-block once (`Super`): its float scale d, the codes of its sub-block J
// (32 unsigned weights, in order), their 16-bit pair multipliers (the sub-block's integer scale: weight i
// of the super-block is d * scale * code + bias, per 16 weights), and
// - `correct`, which adds to a row's float sums (8 lanes) what the integer dot products leave out: the
//   biases (minimums times exact sums of x; offsets times sums of the quantized x, which their codes met);
// - `affine`, each 16 weights' float scale and bias, for dequantization.
template <int64_t Q>
struct KQuant;

template <>
struct KQuant<kQ2_K> {
  // scales[16] (per 16 weights: scale in the low nibble, minimum in the high), qs[64], d, dmin.
  struct Super {
    const uint8_t* b;
    float d;
    Scales16 scales;
    __m256 bias_lo, bias_hi;  // -dmin * minimum of each 16 weights
    explicit Super(const uint8_t* block) : b(block), d(half_at(block + 80)) {
      const __m128i packed = load16(block);
      scales = Scales16::from<false>(_mm_and_si128(packed, _mm_set1_epi8(15)));
      widen16<false>(_mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15)), -half_at(block + 82), bias_lo,
                     bias_hi);
    }
    template <int J>
    __m256i codes() const {
      return bits_of<2 * (J % 4), 2>(load32(b + 16 + 32 * (J / 4)));
    }
    template <int J>
    __m256i scale() const { return scales.of<J>(); }
    __m256 correct(__m256 acc, const QuantizedX& x, int64_t m, int64_t sb) const {
      const float* s = x.sum16 + m * (x.K / 16) + sb * 16;
      acc = _mm256_fmadd_ps(bias_lo, _mm256_loadu_ps(s), acc);
      return _mm256_fmadd_ps(bias_hi, _mm256_loadu_ps(s + 8), acc);
    }
    void affine(float* scale, float* bias) const {
      __m256 lo, hi;
      widen16<false>(_mm_and_si128(load16(b), _mm_set1_epi8(15)), d, lo, hi);
      _mm256_storeu_ps(scale, lo);
      _mm256_storeu_ps(scale + 8, hi);
      _mm256_storeu_ps(bias, bias_lo);
      _mm256_storeu_ps(bias + 8, bias_hi);
    }
  };
};

// Q3_K and Q6_K: every code carries one constant offset (-4, -32) under per-16 scales (d * scale, `lo` for
// weights 0-15 of a sub-block, `hi` for 16-31). `offset_correct` adds the offset's share of a sub-block's dot
// product from x's per-16 sums; `offset_affine` gives the scale and bias a code dequantizes with.
inline __m256 offset_correct(__m256 acc, __m256 lo, __m256 hi, float offset, const float* sums) {
  const __m256 o = _mm256_set1_ps(offset);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(lo, o), _mm256_loadu_ps(sums), acc);
  return _mm256_fmadd_ps(_mm256_mul_ps(hi, o), _mm256_loadu_ps(sums + 8), acc);
}
inline void offset_affine(__m256 lo, __m256 hi, float offset, float* scale, float* bias) {
  const __m256 o = _mm256_set1_ps(offset);
  _mm256_storeu_ps(scale, lo);
  _mm256_storeu_ps(scale + 8, hi);
  _mm256_storeu_ps(bias, _mm256_mul_ps(lo, o));
  _mm256_storeu_ps(bias + 8, _mm256_mul_ps(hi, o));
}

template <>
struct KQuant<kQ3_K> {
  // hmask[32], qs[64], scales[12], d.
  struct Super {
    const uint8_t* b;
    float d;
    __m256i hmask;
    Scales16 scales;
    __m256 scale_lo, scale_hi;  // d * scale of each 16 weights
    explicit Super(const uint8_t* block) : b(block), d(half_at(block + 108)), hmask(load32(block)) {
      alignas(16) int8_t sc[16];
      k3_scales(block + 96, sc);
      const __m128i s = load16(sc);
      scales = Scales16::from<true>(s);
      widen16<true>(s, d, scale_lo, scale_hi);
    }
    template <int J>
    __m256i codes() const {  // the low 2 bits, and bit 2 = the hmask bit (set: no -4 offset)
      return _mm256_or_si256(bits_of<2 * (J % 4), 2>(load32(b + 32 + 32 * (J / 4))), bit_to<J, 2>(hmask));
    }
    template <int J>
    __m256i scale() const { return scales.of<J>(); }
    __m256 correct(__m256 acc, const QuantizedX& x, int64_t m, int64_t sb) const {
      return offset_correct(acc, scale_lo, scale_hi, -4.f, x.qsum16 + m * (x.K / 16) + sb * 16);
    }
    void affine(float* scale, float* bias) const { offset_affine(scale_lo, scale_hi, -4.f, scale, bias); }
  };
};

// Q4_K and Q5_K: d, dmin, scales[12] (a 6-bit scale and minimum per 32 weights), (Q5_K: qh[32]), qs[128].
template <int64_t Q>
struct K45 {
  struct Super {
    const uint8_t* b;
    float d, dmin;
    alignas(8) uint8_t sc[8], mn[8];
    __m256i scales;  // the 8 scales as 16-bit values, in both 128-bit lanes
    __m256i qh;      // Q5_K's fifth bits
    explicit Super(const uint8_t* block) : b(block), d(half_at(block)), dmin(half_at(block + 2)) {
      k4_scales(block + 4, sc, mn);
      scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
      if constexpr (Q == kQ5_K) qh = load32(block + 16);
    }
    template <int J>
    __m256i codes() const {
      const __m256i v = bits_of<4 * (J % 2), 4>(load32(b + (Q == kQ4_K ? 16 : 48) + 32 * (J / 2)));
      if constexpr (Q == kQ5_K) return _mm256_or_si256(v, bit_to<J, 4>(qh));
      return v;
    }
    template <int J>
    __m256i scale() const {  // 16-bit lane J of either 128-bit half, everywhere
      return _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((2 * J + 1) << 8 | 2 * J)));
    }
    __m256 correct(__m256 acc, const QuantizedX& x, int64_t m, int64_t sb) const {
      const __m256 bias = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)))),
          _mm256_set1_ps(-dmin));
      return _mm256_fmadd_ps(bias, _mm256_loadu_ps(x.sum32 + m * (x.K / 32) + sb * 8), acc);
    }
    void affine(float* scale, float* bias) const {
      for (int j = 0; j < 8; ++j) {
        scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(sc[j]);
        bias[2 * j] = bias[2 * j + 1] = -dmin * static_cast<float>(mn[j]);
      }
    }
  };
};
template <>
struct KQuant<kQ4_K> : K45<kQ4_K> {};
template <>
struct KQuant<kQ5_K> : K45<kQ5_K> {};

template <>
struct KQuant<kQ6_K> {
  // ql[128], qh[64], scales[16] (int8, per 16 weights), d; offset -32.
  struct Super {
    const uint8_t* b;
    float d;
    Scales16 scales;
    __m256 scale_lo, scale_hi;  // d * scale of each 16 weights
    explicit Super(const uint8_t* block) : b(block), d(half_at(block + 208)) {
      const __m128i s = load16(block + 192);
      scales = Scales16::from<true>(s);
      widen16<true>(s, d, scale_lo, scale_hi);
    }
    template <int J>
    __m256i codes() const {  // J = 4h + s: ql's nibble and qh's 2 bits (see dequant_block)
      constexpr int h = J / 4, s = J % 4;
      const __m256i lo = bits_of<4 * (s / 2), 4>(load32(b + 64 * h + 32 * (s % 2)));
      const __m256i hi = bits_of<2 * s, 2>(load32(b + 128 + 32 * h));
      return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    template <int J>
    __m256i scale() const { return scales.of<J>(); }
    __m256 correct(__m256 acc, const QuantizedX& x, int64_t m, int64_t sb) const {
      return offset_correct(acc, scale_lo, scale_hi, -32.f, x.qsum16 + m * (x.K / 16) + sb * 16);
    }
    void affine(float* scale, float* bias) const { offset_affine(scale_lo, scale_hi, -32.f, scale, bias); }
  };
};

// ---- SIMD dequantization.

// 32 codes (signed or not) to floats at y: weights 0-15 code * s0 + b0, 16-31 code * s1 + b1.
template <bool Signed>
inline void store_affine(__m256i codes, float s0, float b0, float s1, float b1, float* y) {
  const __m128i c[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  const float s[2] = {s0, s1}, b[2] = {b0, b1};
  STRATA_UNROLL
  for (int h = 0; h < 2; ++h) {
#if defined(__AVX512F__)
    const __m512i wide = Signed ? _mm512_cvtepi8_epi32(c[h]) : _mm512_cvtepu8_epi32(c[h]);
    _mm512_storeu_ps(y + 16 * h,
                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(wide), _mm512_set1_ps(s[h]), _mm512_set1_ps(b[h])));
#else
    const __m128i halves[2] = {c[h], _mm_srli_si128(c[h], 8)};
    STRATA_UNROLL
    for (int q = 0; q < 2; ++q) {
      const __m256i wide = Signed ? _mm256_cvtepi8_epi32(halves[q]) : _mm256_cvtepu8_epi32(halves[q]);
      _mm256_storeu_ps(y + 16 * h + 8 * q,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(s[h]), _mm256_set1_ps(b[h])));
    }
#endif
  }
}

// `blocks` blocks of a quantized type from `row`, as float32 at y.
template <int64_t Q>
void dequant_blocks_simd(const uint8_t* row, int64_t blocks, float* y) {
  using L = Layout<Q>;
  if constexpr (L::kElems == 32) {
    using D = Legacy<Q>;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * L::kBytes;
      const float d = half_at(blk), bias = D::kMin ? half_at(blk + 2) : -static_cast<float>(D::kOffset) * d;
      store_affine<Q == kQ8_0>(D::codes(blk), d, bias, d, bias, y + 32 * b);
    }
  } else {
    for (int64_t b = 0; b < blocks; ++b) {
      const typename KQuant<Q>::Super s(row + b * L::kBytes);
      alignas(32) float scale[16], bias[16];
      s.affine(scale, bias);
      float* out = y + 256 * b;
      [&]<int... J>(std::integer_sequence<int, J...>) {
        (store_affine<false>(s.template codes<J>(), scale[2 * J], bias[2 * J], scale[2 * J + 1], bias[2 * J + 1],
                             out + 32 * J),
         ...);
      }(std::make_integer_sequence<int, 8>());
    }
  }
}

// ---- The int8 decode path.

// MB rows of x times R legacy-type weight rows (`pitch` bytes apart) of nb blocks each; sums[r * MB + m]. Per
// block, one integer dot product of its codes with each row of x, converted to float and scaled by the block's
// and x's scales. Blocks go in groups of G (8, and 4, 2, 1 for the rest: each size unrolled at compile time)
// whose scales (and minimums) are gathered and converted together (`halves`); each row of x then has its G
// products of scales in a vector (each block's taken out by one vpermps), and folds the offsets or minimums
// into one vector per group. Q8_0's weights are widened to int16 and meet x in int16 (`kResidual`). Several
// chains of float sums at 1-2 rows of x, so that consecutive blocks do not wait on one FMA. At one row of x
// two weight rows go at once (R = 2): a row of few blocks otherwise waits on its final sums (a chain of
// dependent additions), which made rows of 576 weights (18 blocks) about 20% slower; at two rows of x the
// registers no longer hold it all. Every output is summed the same way whatever rows the thread split pairs it
// with: the engine may change the thread count between steps, and a greedy decode must not change with it.
template <int64_t Q, int MB, int R>
void legacy_rows(const uint8_t* w, int64_t pitch, int64_t nb, const QuantizedX& x, float* sums) {
  using L = Layout<Q>;
  using D = Legacy<Q>;
  // The chains depend on MB alone: a weight row sums in the same order whether it goes alone or in a pair
  // (which the split over threads decides), so that its result does not change with the thread count.
  constexpr int kChains = MB <= 2 ? 2 : 1;
  __m256 acc[R][kChains][MB], corr[R][MB];
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      corr[r][m] = _mm256_setzero_ps();
      for (int c = 0; c < kChains; ++c) acc[r][c][m] = _mm256_setzero_ps();
    }
  }
  const int64_t K = x.K;
  const auto group = [&]<int G>(int64_t b0) {
    __m256 scale[R][MB];  // x's scale times the weights', per block of the group
    STRATA_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* first = w + r * pitch + b0 * L::kBytes;
      const __m256 dw = halves(first, L::kBytes, G);
      STRATA_UNROLL
      for (int m = 0; m < MB; ++m) {
        scale[r][m] = _mm256_mul_ps(dw, load_floats(x.d + m * nb + b0, G));
        if constexpr (D::kOffset != 0) {
          corr[r][m] = _mm256_fmadd_ps(dw, load_floats(x.qsum32 + m * nb + b0, G), corr[r][m]);
        } else if constexpr (D::kMin) {
          corr[r][m] =
              _mm256_fmadd_ps(halves(first + 2, L::kBytes, G), load_floats(x.sum32 + m * nb + b0, G), corr[r][m]);
        }
      }
    }
    [&]<int... J>(std::integer_sequence<int, J...>) {
      (
          [&] {
            STRATA_UNROLL
            for (int r = 0; r < R; ++r) {
              const uint8_t* block = w + r * pitch + (b0 + J) * L::kBytes;
              __m256i lo, hi;  // Q8_0's weights in int16, else the codes in lo
              if constexpr (Q == kQ8_0) {
                lo = _mm256_cvtepi8_epi16(load16(block + 2));
                hi = _mm256_cvtepi8_epi16(load16(block + 18));
              } else {
                lo = D::codes(block);
              }
              STRATA_UNROLL
              for (int m = 0; m < MB; ++m) {
                __m256i p;
                if constexpr (Q == kQ8_0) {
                  const int16_t* xm = x.q16 + m * K + (b0 + J) * 32;
                  p = dot_s16(dot_s16(_mm256_setzero_si256(), lo, load32(xm)), hi, load32(xm + 16));
                } else {
                  p = dot_u8s8(_mm256_setzero_si256(), lo, load32(x.q + m * K + (b0 + J) * 32));
                }
                __m256& a = acc[r][J % kChains][m];
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                    _mm256_permutevar8x32_ps(scale[r][m], _mm256_set1_epi32(J)), a);
              }
            }
          }(),
          ...);
    }(std::make_integer_sequence<int, G>());
  };
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) group.template operator()<8>(b0);
  if (nb - b0 >= 4) group.template operator()<4>(b0), b0 += 4;
  if (nb - b0 >= 2) group.template operator()<2>(b0), b0 += 2;
  if (nb - b0 >= 1) group.template operator()<1>(b0);
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MB; ++m) {
      __m256 t = acc[r][0][m];
      for (int c = 1; c < kChains; ++c) t = _mm256_add_ps(t, acc[r][c][m]);
      if constexpr (D::kOffset != 0) {
        t = _mm256_fmadd_ps(corr[r][m], _mm256_set1_ps(-static_cast<float>(D::kOffset)), t);
      }
      if constexpr (D::kMin) t = _mm256_add_ps(t, corr[r][m]);
      sums[r * MB + m] = hsum(t);
    }
  }
}

// MB rows of x times one K-quant weight row of nsb super-blocks: each sub-block's codes meet every row of x
// in an integer dot product with the sub-block's scale applied in 16 bits, summed over the super-block in
// 32-bit lanes; then scaled by d and x's scale into float, with the correction. Two integer chains at 1-2
// rows (a VNNI accumulation waits on the previous one): x's residual has its own (summed apart: shifted
// onto the main sums it could overflow 32 bits).
template <int64_t Q, int MB>
void kquant_row(const uint8_t* w, int64_t nsb, const QuantizedX& x, float* sums) {
  using L = Layout<Q>;
  using S = typename KQuant<Q>::Super;
  constexpr int kChains = MB <= 2 && !kResidual<Q> ? 2 : 1;
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t K = x.K;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const S s(w + sb * L::kBytes);
    __m256i iacc[kChains][MB];
    for (int c = 0; c < kChains; ++c)
      for (int m = 0; m < MB; ++m) iacc[c][m] = _mm256_setzero_si256();
    __m256i racc[MB];  // x's residual's sums
    for (int m = 0; m < MB; ++m) racc[m] = _mm256_setzero_si256();
    const int8_t* xq = x.q + sb * 256;
    [&]<int... J>(std::integer_sequence<int, J...>) {
      (
          [&] {
            const __m256i u = s.template codes<J>(), sc = s.template scale<J>();
            STRATA_UNROLL
            for (int m = 0; m < MB; ++m) {
              iacc[J % kChains][m] = dot_u8s8_scaled(iacc[J % kChains][m], u, load32(xq + m * K + 32 * J), sc);
              if constexpr (kResidual<Q>) {
                racc[m] = dot_u8s8_scaled(racc[m], u, load32(x.r + m * K + sb * 256 + 32 * J), sc);
              }
            }
          }(),
          ...);
    }(std::make_integer_sequence<int, 8>());
    STRATA_UNROLL
    for (int m = 0; m < MB; ++m) {
      __m256i t = iacc[0][m];
      if constexpr (kChains > 1) t = _mm256_add_epi32(t, iacc[1][m]);
      const float scale = s.d * x.d[m * nsb + sb];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(scale), acc[m]);
      if constexpr (kResidual<Q>) {
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(racc[m]), _mm256_set1_ps(scale / 128.f), acc[m]);
      }
      acc[m] = s.correct(acc[m], x, m, sb);
    }
  }
  for (int m = 0; m < MB; ++m) sums[m] = hsum(acc[m]);
}


// ---- The batch path: more than kMaxDecodeRows rows of x.
//
// In decode each row of x meets each weight block in a dot product of its own, reduced across lanes and
// scaled per block. With more rows each thread instead repacks 8 weight rows (a tile) so that a vector's
// 32-bit lane r holds row r's weights (widened to int16) for 2 inputs, which one broadcast of x supplies to
// all 8 lanes: 32 weights of 8 rows take 16 dot products per row of x, whose sums come out one output per
// lane, ready for the rows' scales. The repacked tile stays in the thread's L1/L2 cache while every row of x
// passes over it.

// How a type's weights meet x in the batch path: in int16 (`quantize_batch`), for every type. int8 x, as
// decode takes for 2- to 5-bit weights, would halve the dot products, but a prompt's x then moved a tiny
// Gemma 2's first logprob (Q5_1) by 0.07 from the float reference, where the float panels this path replaced
// had kept prefill exact. Scales (and minimums) apply per group of kGroup weights: a legacy block, a
// Q4_K/Q5_K sub-block, or 16 weights of the other K-quants.
template <int64_t Q>
struct Batch {
  static constexpr bool kLegacy = Layout<Q>::kElems == 32;
  static constexpr int kGroup = kLegacy || Q == kQ4_K || Q == kQ5_K ? 32 : 16;
  static constexpr int kGroups = 32 / kGroup;  // per 32 weights
  static constexpr int kSteps = 16;            // vectors per 32 weights (2 weights of 8 rows each)
  static constexpr int kOffset = [] {
    if constexpr (kLegacy) return Legacy<Q>::kOffset;
    return Q == kQ3_K ? 4 : Q == kQ6_K ? 32 : 0;
  }();
  static constexpr bool kMin = [] {
    if constexpr (kLegacy) return Legacy<Q>::kMin;
    return Q == kQ2_K || Q == kQ4_K || Q == kQ5_K;
  }();
  static constexpr int kVectors = kSteps + kGroups * (1 + kMin);  // per 32 weights of a tile
};

// 8 vectors' 32-bit lanes transposed: lane j of v[i] goes to lane i of v[j].
inline void transpose8x32(__m256i (&v)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// One GGUF block of a tile's `rows` weight rows (the first at `first`, `pitch` bytes apart; the others
// taken as zero) into `out`: per 32 weights (`stride` vectors apart), Batch's kVectors vectors: the steps
// (lane r: row r's two codes in int16 for the step's 2 inputs), then per group the rows' float scales (and
// minimums).
template <int64_t Q>
void pack_block(const uint8_t* first, int64_t pitch, int rows, __m256i* out, int64_t stride) {
  using B = Batch<Q>;
  constexpr int kChunks = Layout<Q>::kElems / 32, kGroups = kChunks * B::kGroups;
  __m256i codes[kChunks][8];
  alignas(32) float scale[kGroups][8] = {}, minimum[kGroups][8] = {};
  for (int r = 0; r < 8; ++r) {
    const uint8_t* b = first + r * pitch;
    if (r >= rows) {
      for (int c = 0; c < kChunks; ++c) codes[c][r] = _mm256_setzero_si256();
    } else if constexpr (B::kLegacy) {
      codes[0][r] = Legacy<Q>::codes(b);
      scale[0][r] = half_at(b);
      if constexpr (B::kMin) minimum[0][r] = half_at(b + 2);
    } else {
      const typename KQuant<Q>::Super s(b);
      [&]<int... J>(std::integer_sequence<int, J...>) {
        ((codes[J][r] = s.template codes<J>()), ...);
      }(std::make_integer_sequence<int, 8>());
      alignas(32) float sc[16], bias[16];  // per 16 weights
      s.affine(sc, bias);
      for (int g = 0; g < kGroups; ++g) {
        scale[g][r] = sc[g * B::kGroup / 16];
        minimum[g][r] = bias[g * B::kGroup / 16];
      }
    }
  }
  for (int c = 0; c < kChunks; ++c) {
    __m256i* o = out + c * stride;
    for (int h = 0; h < 2; ++h) {  // weights 0-15, then 16-31
      __m256i wide[8];
      for (int r = 0; r < 8; ++r) {
        const __m128i half = h == 0 ? _mm256_castsi256_si128(codes[c][r]) : _mm256_extracti128_si256(codes[c][r], 1);
        wide[r] = Q == kQ8_0 ? _mm256_cvtepi8_epi16(half) : _mm256_cvtepu8_epi16(half);
      }
      transpose8x32(wide);
      for (int s = 0; s < 8; ++s) _mm256_store_si256(o + 8 * h + s, wide[s]);
    }
    for (int g = 0; g < B::kGroups; ++g) {
      __m256i* v = o + B::kSteps + g * (1 + B::kMin);
      v[0] = _mm256_castps_si256(_mm256_load_ps(scale[c * B::kGroups + g]));
      if constexpr (B::kMin) v[1] = _mm256_castps_si256(_mm256_load_ps(minimum[c * B::kGroups + g]));
    }
  }
}

// Rows m0 .. m0 + MB - 1 of x times T repacked tiles (`tiles`: per 32 weights, each tile's kVectors), into
// out's columns n0 .. n0 + 8 T - 1 (those below N). Every output is one lane's chain, its groups in order,
// each an integer dot product (started from the offset's correction) scaled into a float sum: the same
// whatever MB, T and thread it is computed with.
template <int64_t Q, int T, int MB>
void batch_rows(const __m256i* tiles, int64_t K, const BatchX& x, int64_t m0,
                const float* bias, float* out, int64_t N, int64_t n0) {
  using B = Batch<Q>;
  constexpr int kGroupSteps = B::kSteps / B::kGroups;
  const int64_t nb = K / 32, ng = K / B::kGroup;
  __m256 acc[T][MB];
  for (int t = 0; t < T; ++t)
    for (int m = 0; m < MB; ++m) acc[t][m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < nb; ++c) {
    const __m256i* rec = tiles + c * T * B::kVectors;
    const uint8_t* xc = reinterpret_cast<const uint8_t*>(x.q + m0 * K + 32 * c);
    STRATA_UNROLL
    for (int g = 0; g < B::kGroups; ++g) {
      const int64_t group = c * B::kGroups + g;
      __m256i ia[T][MB];
      STRATA_UNROLL
      for (int m = 0; m < MB; ++m) {
        const __m256i init =
            B::kOffset != 0 ? _mm256_set1_epi32(x.init[(m0 + m) * ng + group]) : _mm256_setzero_si256();
        for (int t = 0; t < T; ++t) ia[t][m] = init;
      }
      STRATA_UNROLL
      for (int s = g * kGroupSteps; s < (g + 1) * kGroupSteps; ++s) {
        __m256i wv[T];
        STRATA_UNROLL
        for (int t = 0; t < T; ++t) wv[t] = _mm256_load_si256(rec + t * B::kVectors + s);
        STRATA_UNROLL
        for (int m = 0; m < MB; ++m) {
          const __m256i xv = _mm256_set1_epi32(static_cast<int32_t>(u32_at(xc + m * K * 2 + 4 * s)));
          STRATA_UNROLL
          for (int t = 0; t < T; ++t) ia[t][m] = dot_s16(ia[t][m], wv[t], xv);
        }
      }
      STRATA_UNROLL
      for (int m = 0; m < MB; ++m) {
        const __m256 dx = _mm256_set1_ps(x.d[(m0 + m) * nb + c]);
        STRATA_UNROLL
        for (int t = 0; t < T; ++t) {
          const __m256i* v = rec + t * B::kVectors + B::kSteps + g * (1 + B::kMin);
          const __m256 scale = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_load_si256(v)), dx);
          acc[t][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[t][m]), scale, acc[t][m]);
          if constexpr (B::kMin) {
            acc[t][m] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_load_si256(v + 1)),
                                        _mm256_set1_ps(x.sum[(m0 + m) * ng + group]), acc[t][m]);
          }
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t n = n0 + 8 * t;
    const int g = static_cast<int>(std::clamp<int64_t>(N - n, 0, 8));
    if (g == 0) break;
    const __m256 bv = bias ? load_floats(bias + n, g) : _mm256_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m256 v = _mm256_add_ps(acc[t][m], bv);
      float* o = out + (m0 + m) * N + n;
      if (g == 8) {
        _mm256_storeu_ps(o, v);
      } else {
        alignas(32) float sums[8];
        _mm256_store_ps(sums, v);
        std::memcpy(o, sums, g * sizeof(float));
      }
    }
  }
}

#if defined(__AVX512F__)
constexpr int kBatchTiles = 2;  // 2 tiles by 4 rows of x: 8 chains of dot products, VNNI's latency times rate
#else
constexpr int kBatchTiles = 1;  // within AVX2's 16 registers
#endif
constexpr int kBatchPassRows = 4;
// Multiply-adds a thread must get before a second one is woken.
constexpr int64_t kMinBatchWorkPerThread = 512 * 1024;

// out = x @ W.T (+ bias): units of kBatchTiles tiles split over the threads, each unit repacked
// (`pack_block`) and then met by x's rows kBatchPassRows at a time.
template <int64_t Q>
void batch(const uint8_t* w, int64_t pitch, const float* x, const float* bias, float* out, int64_t M, int64_t N,
           int64_t K) {
  using B = Batch<Q>;
  using L = Layout<Q>;
  constexpr int T = kBatchTiles;
  const BatchX xq = quantize_batch<B::kGroup>(x, M, K, B::kOffset);
  const int64_t nb = K / L::kElems, chunks = K / 32, span = 8 * T, units = (N + span - 1) / span;
  const int64_t grain = std::max<int64_t>(1, kMinBatchWorkPerThread / (span * K * M));
  at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<int32_t> buffer;  // the tiles, from its first 32-byte boundary
    const int64_t vectors = chunks * T * B::kVectors;
    if (static_cast<int64_t>(buffer.size()) < 8 * vectors + 7) buffer.resize(8 * vectors + 7);
    __m256i* tiles = reinterpret_cast<__m256i*>((reinterpret_cast<uintptr_t>(buffer.data()) + 31) & ~uintptr_t{31});
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n0 = u * span;
      for (int64_t b = 0; b < nb; ++b) {
        for (int t = 0; t < T; ++t) {
          const int64_t n = n0 + 8 * t;
          const int rows = static_cast<int>(std::clamp<int64_t>(N - n, 0, 8));
          pack_block<Q>(w + std::min(n, N - 1) * pitch + b * L::kBytes, pitch, rows,
                        tiles + (b * L::kElems / 32 * T + t) * B::kVectors, T * B::kVectors);
        }
      }
      const auto pass = [&]<int MB>(int64_t m0) { batch_rows<Q, T, MB>(tiles, K, xq, m0, bias, out, N, n0); };
      int64_t m0 = 0;
      for (; m0 + kBatchPassRows <= M; m0 += kBatchPassRows) pass.template operator()<kBatchPassRows>(m0);
      [&]<int... R>(std::integer_sequence<int, R...>) {  // the last M % kBatchPassRows rows
        ((M - m0 == R + 1 ? pass.template operator()<R + 1>(m0) : void()), ...);
      }(std::make_integer_sequence<int, kBatchPassRows - 1>());
    }
  });
}

#endif  // STRATA_GGUF_AVX2

// Whether a type takes the integer paths, decode's and the batch path (every quantized type on x86 with
// AVX2); the others, and every type elsewhere, take the float path and the float panels.
template <int64_t Q>
constexpr bool kInt8Path =
#if STRATA_GGUF_AVX2
    Layout<Q>::kElems > 1;
#else
    false;
#endif

// ---------------------------------------------------------------------------------------------------------
// Dequantization of whole rows (the embedding, the wide path's panels, the float decode path's spans).

// `elems` weights of a row (a whole number of blocks) from its bytes at `row`, as float32.
template <int64_t Q>
void dequant_span(const uint8_t* row, int64_t elems, float* y) {
  using L = Layout<Q>;
  if constexpr (Q == kF32) {
    std::memcpy(y, row, elems * sizeof(float));
  } else if constexpr (Q == kF16 || Q == kBF16) {
    using T = std::conditional_t<Q == kF16, c10::Half, c10::BFloat16>;
    const T* w = reinterpret_cast<const T*>(row);  // read by unaligned loads and memcpy only
    int64_t k = 0;
    for (; k + kLanes <= elems; k += kLanes) {
      const auto v = strata_kernels::load_tile(w + k);
      std::memcpy(y + k, &v, sizeof(v));
    }
    if (k < elems) {
      const auto v = load_tile_n(w + k, elems - k);
      std::memcpy(y + k, &v, (elems - k) * sizeof(float));
    }
  } else {
#if STRATA_GGUF_AVX2
    dequant_blocks_simd<Q>(row, elems / L::kElems, y);
#else
    for (int64_t b = 0; b < elems / L::kElems; ++b) dequant_block<Q>(row + b * L::kBytes, y + b * L::kElems);
#endif
  }
}

void dequant_row(int64_t qtype, const uint8_t* row, int64_t K, float* y) {
  with_qtype(qtype, "gguf", [&](auto tag) { dequant_span<decltype(tag)::value>(row, K, y); });
}

// ---------------------------------------------------------------------------------------------------------
// The float decode path: MB rows of x (K apart) times one weight row, its span of kSpan weights at a time
// dequantized into an L1 buffer (F16/BF16/F32 rows are widened straight from the row). Each row of x keeps
// two register tiles of sums.

constexpr int64_t kSpan = 256;

inline float tile_total(const Tile& t) {
  strata_kernels::NativeTile s = t.part[0];
  STRATA_UNROLL
  for (int i = 1; i < Tile::kParts; ++i) s += t.part[i];
  return strata_kernels::lane_total(s)[0];
}

template <int MB, typename T>
inline void float_dots(const T* w, const float* x, int64_t ldx, int64_t len, Tile (&acc)[MB][2]) {
  int64_t k = 0;
  for (; k + 2 * kLanes <= len; k += 2 * kLanes) {
    const Tile w0 = load_register_tile(w + k), w1 = load_register_tile(w + k + kLanes);
    STRATA_UNROLL
    for (int m = 0; m < MB; ++m) {
      acc[m][0] += load_register_tile(x + m * ldx + k) * w0;
      acc[m][1] += load_register_tile(x + m * ldx + k + kLanes) * w1;
    }
  }
  for (; k < len; k += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - k);
    const Tile wv = to_registers(load_tile_n(w + k, n));
    STRATA_UNROLL
    for (int m = 0; m < MB; ++m) acc[m][0] += to_registers(load_tile_n(x + m * ldx + k, n)) * wv;
  }
}

template <int64_t Q, int MB>
void float_row(const uint8_t* row, const float* x, int64_t K, float* sums) {
  Tile acc[MB][2] = {};
  if constexpr (Q == kF32) {
    float_dots<MB>(reinterpret_cast<const float*>(row), x, K, K, acc);
  } else if constexpr (Q == kF16) {
    float_dots<MB>(reinterpret_cast<const c10::Half*>(row), x, K, K, acc);
  } else if constexpr (Q == kBF16) {
    float_dots<MB>(reinterpret_cast<const c10::BFloat16*>(row), x, K, K, acc);
  } else {
    alignas(64) float buf[kSpan];
    using L = Layout<Q>;
    for (int64_t k = 0; k < K; k += kSpan) {
      const int64_t len = std::min<int64_t>(kSpan, K - k);  // whole blocks: K and kSpan are multiples of 32
      dequant_span<Q>(row + k / L::kElems * L::kBytes, len, buf);
      float_dots<MB>(static_cast<const float*>(buf), x + k, K, len, acc);
    }
  }
  for (int m = 0; m < MB; ++m) {
    acc[m][0] += acc[m][1];
    sums[m] = tile_total(acc[m][0]);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Decode: rows [begin, end) of the weight, MB rows of x.

// Up to this many rows of x decode; more take the batch path (quantized types with AVX2) or the float panels.
// On one Zen 4 core the batch path's repacking and int16 x paid for themselves from about 8 rows.
constexpr int64_t kMaxDecodeRows = 8;

// Without VNNI, above this many rows the float panels take over from the batch path: its int16 dot products
// (vpmaddwd and an add) then only match the float GEMM's FMAs, and on Zen 4 built for x86-64-v3 it ran
// 0.66-0.98x the panels' speed at 64-512 rows (1.0-1.5x at 9-32).
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
constexpr int64_t kMaxBatchRows = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kMaxBatchRows = 32;
#endif

template <int64_t Q, int MB>
void decode_rows(const uint8_t* w, int64_t pitch, const float* x, const QuantizedX& xq, const float* bias,
                 float* out, int64_t N, int64_t K, int64_t begin, int64_t end) {
  int64_t n = begin;
#if STRATA_GGUF_AVX2
  if constexpr (kInt8Path<Q> && Layout<Q>::kElems == 32 && MB == 1) {
    for (; n + 2 <= end; n += 2) {
      float sums[2 * MB];
      legacy_rows<Q, MB, 2>(w + n * pitch, pitch, K / 32, xq, sums);
      for (int r = 0; r < 2; ++r) {
        const float b = bias ? bias[n + r] : 0.f;
        for (int m = 0; m < MB; ++m) out[m * N + n + r] = sums[r * MB + m] + b;
      }
    }
  }
#endif
  for (; n < end; ++n) {
    const uint8_t* row = w + n * pitch;
    float sums[MB];
    if constexpr (kInt8Path<Q>) {
#if STRATA_GGUF_AVX2
      if constexpr (Layout<Q>::kElems == 32) {
        legacy_rows<Q, MB, 1>(row, pitch, K / 32, xq, sums);
      } else {
        kquant_row<Q, MB>(row, K / 256, xq, sums);
      }
#endif
    } else {
      float_row<Q, MB>(row, x, K, sums);
    }
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < MB; ++m) out[m * N + n] = sums[m] + b;
  }
}

template <int64_t Q>
void decode_rows_m(int64_t M, const uint8_t* w, int64_t pitch, const float* x, const QuantizedX& xq,
                   const float* bias, float* out, int64_t N, int64_t K, int64_t begin, int64_t end) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((M == I + 1 ? decode_rows<Q, I + 1>(w, pitch, x, xq, bias, out, N, K, begin, end) : void()), ...);
  }(std::make_integer_sequence<int, kMaxDecodeRows>());
}

// A layer is split over threads only when each thread gets at least this much work, counted in weight
// bytes times (M + 1) / 2 (more rows of x, more arithmetic per byte): waking a second thread costs about
// 3 us, and on two Zen 4 cores at one row of x Q4_0 layers of 91 and 122 KiB ran slower split (9.4 and
// 10.3 us against 7.7 and 9.5), one of 182 KiB faster (8.9 us against 12.9).
constexpr int64_t kMinWorkPerThread = 80 * 1024;

template <int64_t Q>
void decode(const uint8_t* w, int64_t pitch, const float* x, const float* bias, float* out, int64_t M,
            int64_t N, int64_t K) {
  QuantizedX xq;
#if STRATA_GGUF_AVX2
  if constexpr (Q == kQ8_0) {
    const BatchX x16 = quantize_batch<32>(x, M, K, 0);
    xq.K = K;
    xq.block = 32;
    xq.q16 = x16.q;
    xq.d = x16.d;
  } else if constexpr (kInt8Path<Q>) {
    xq = quantize_x(x, M, K, Layout<Q>::kElems, kResidual<Q>);
  }
#endif
  const int64_t row_bytes = K / Layout<Q>::kElems * Layout<Q>::kBytes;
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, row_bytes * (M + 1) / 2));
  const auto run = [&](int64_t begin, int64_t end) {
    decode_rows_m<Q>(M, w, pitch, x, xq, bias, out, N, K, begin, end);
  };
  if (N < 2 * grain) {  // (at::parallel_for would split N >= grain rows in two, each below the grain)
    run(0, N);
  } else {
    at::parallel_for(0, N, grain, run);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Wide x on F16/BF16/F32 weights (and every type without AVX2): panels of weight rows dequantized into a
// float32 scratch and multiplied by x with ATen's GEMM, one panel per call on each thread (single-threaded
// inside the parallel region), straight into out's columns. Panels of about kPanelFloats (1 MiB, one L2
// cache): smaller ones pay ATen's per-call overhead and the GEMM's packing of x too often (at M = 32,
// 64K-float panels ran at 1.2-1.5x a dense float32 linear's time, 256K-float ones at 1.0-1.1x). The panels,
// equal multiples of 16 rows, depend on the weight's shape alone, not on the thread count (which the engine
// may change between steps): each output is then the same GEMM's whatever thread computes it.

constexpr int64_t kPanelFloats = 256 * 1024;
// Multiply-adds below which a thread is not worth waking (about 10 us of a GEMM's work).
constexpr int64_t kMinWideWorkPerThread = 256 * 1024;

template <int64_t Q>
void wide(const uint8_t* w, int64_t pitch, const at::Tensor& x, at::Tensor& out, int64_t M, int64_t N, int64_t K) {
  const int64_t wanted = std::max<int64_t>(1, (N * K + kPanelFloats - 1) / kPanelFloats);
  const int64_t rows = std::min<int64_t>(N, (N + wanted * 16 - 1) / (wanted * 16) * 16);
  const int64_t panels = (N + rows - 1) / rows;
  const int64_t panel_work = std::max<int64_t>(1, M * rows * K);
  const int64_t grain = std::max<int64_t>(1, (kMinWideWorkPerThread + panel_work - 1) / panel_work);
  // ATen's worker threads do not inherit the caller's inference mode, and `out`, made under it, may only be
  // written to under it.
  const bool inference = c10::InferenceMode::is_enabled();
  const auto run = [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < rows * K) scratch.resize(rows * K);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * rows, count = std::min(rows, N - n0);
      for (int64_t i = 0; i < count; ++i) dequant_span<Q>(w + (n0 + i) * pitch, K, scratch.data() + i * K);
      const at::Tensor panel = at::from_blob(scratch.data(), {count, K}, x.options());
      at::Tensor target = out.narrow(1, n0, count);
      at::mm_out(target, x, panel.t());
    }
  };
  at::parallel_for(0, panels, grain, run);
}

// ---------------------------------------------------------------------------------------------------------
// The ops.

// qweight as [rows, row_bytes] bytes with unit column stride (copied only when it has another), checked.
at::Tensor checked_qweight(const at::Tensor& qweight, const char* op) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "strata_cpu::", op, ": qweight must be uint8 (GGUF bytes), got ",
              qweight.scalar_type());
  TORCH_CHECK(qweight.dim() == 2, "strata_cpu::", op, ": qweight must be [rows, row_bytes], got ", qweight.sizes());
  TORCH_CHECK(qweight.device().is_cpu(), "strata_cpu::", op, ": qweight must be on the CPU");
  return qweight.size(1) <= 1 || qweight.stride(1) == 1 ? qweight : qweight.contiguous();
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype,
                       const std::optional<at::Tensor>& bias) {
  const auto [elems, bytes] = block_layout(qtype, "gguf_linear");
  const at::Tensor w = checked_qweight(qweight, "gguf_linear");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
              "strata_cpu::gguf_linear: x must be float32 [M, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(K % elems == 0 && row_bytes == K / elems * bytes, "strata_cpu::gguf_linear: x has ", K,
              " features, which GGUF type ", qtype, " (", elems, " weights in ", bytes, " bytes a block) stores in ",
              K % elems == 0 ? std::to_string(K / elems * bytes) + " bytes a row" : std::string("no whole blocks"),
              ", but qweight's rows have ", row_bytes);
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && at::isFloatingType(bias->scalar_type()),
                "strata_cpu::gguf_linear: bias must be a floating [", N, "] tensor, got ", bias->scalar_type(), " ",
                bias->sizes());
    b = strata_kernels::as_float_contiguous(*bias);
  }
  if (M == 0 || N == 0 || K == 0) {
    at::Tensor out = at::zeros({M, N}, x.options());
    return bias && M > 0 ? out.add_(b) : out;
  }
  const at::Tensor xc = x.contiguous();
  const uint8_t* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const int64_t pitch = w.stride(0);
  at::Tensor out = at::empty({M, N}, x.options());
  with_qtype(qtype, "gguf_linear", [&](auto tag) {
    constexpr int64_t Q = decltype(tag)::value;
    const float* bp = bias ? b.const_data_ptr<float>() : nullptr;
    if (M <= kMaxDecodeRows) {
      decode<Q>(wp, pitch, xc.const_data_ptr<float>(), bp, out.mutable_data_ptr<float>(), M, N, K);
    } else if (kInt8Path<Q> && M <= kMaxBatchRows) {
#if STRATA_GGUF_AVX2
      if constexpr (kInt8Path<Q>) {
        batch<Q>(wp, pitch, xc.const_data_ptr<float>(), bp, out.mutable_data_ptr<float>(), M, N, K);
      }
#endif
    } else {
      wide<Q>(wp, pitch, xc, out, M, N, K);
      if (bias) out.add_(b);
    }
  });
  return out;
}

at::Tensor gguf_embedding(const at::Tensor& qweight, const at::Tensor& ids, int64_t qtype) {
  const auto [elems, bytes] = block_layout(qtype, "gguf_embedding");
  const at::Tensor w = checked_qweight(qweight, "gguf_embedding");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "strata_cpu::gguf_embedding: ids must be int64 (or int32), got ", ids.scalar_type());
  const int64_t V = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(row_bytes % bytes == 0, "strata_cpu::gguf_embedding: qweight's rows have ", row_bytes,
              " bytes, not whole blocks of GGUF type ", qtype, " (", bytes, " bytes each)");
  const int64_t K = row_bytes / bytes * elems;
  const at::Tensor idc = ids.to(at::kLong).contiguous();
  const int64_t* id = idc.const_data_ptr<int64_t>();
  const int64_t n = idc.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < V, "strata_cpu::gguf_embedding: id ", id[i], " is out of range for ", V,
                " rows");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, ids.options().dtype(at::kFloat));
  if (n == 0 || K == 0) return out;
  const uint8_t* wp = static_cast<const uint8_t*>(w.const_data_ptr());
  const int64_t pitch = w.stride(0);
  float* o = out.mutable_data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 64 * 1024 / K);  // a prompt's rows over threads, a step's on one
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequant_row(qtype, wp + id[i] * pitch, K, o + i * K);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(strata_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor qweight, int qtype, Tensor? bias) -> Tensor");
  m.def("gguf_embedding(Tensor qweight, Tensor ids, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_embedding", &gguf_embedding);
}
