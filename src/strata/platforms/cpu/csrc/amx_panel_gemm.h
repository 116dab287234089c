// Strata's float32 GEMM at PyTorch's "high" matmul precision, on Intel AMX: out[m, n] = sum_k x[m, k] * w[n, k]
// (+ bias[n]), each float32 operand taken as the sum of two bfloat16 numbers (hi + lo, about 16 bits of
// mantissa) and multiplied as hi*hi + hi*lo + lo*hi with float32 sums. That is what
// `torch.set_float32_matmul_precision("high")` allows ("bf16x3"); the default ("highest") keeps the float32
// panels of `panel_gemm.h`.
//
// Why: at 32 rows of x a float32 weight byte carries 16 FLOPs, which on AVX-512 FMAs puts a decode batch at
// the ridge of the roofline, where one core's weight stream and its FMAs overlap only in part. The AMX tiles
// do the three bfloat16 products several times as fast as the FMAs do one float32 product, which leaves the
// GEMM mostly waiting on its weight stream. The weights take the same 4 bytes each (hi and lo).
//
// Layout. The weight is packed in items of two 16-column tiles: columns [32 g, 32 g + 32) of a plain weight,
// or, for a GLU MLP's [gate; up], the gate rows [16 g, 16 g + 16) and the up rows of the same outputs. Per
// item and per 32 of K (K padded with zeros), four 1 KB blocks: tile 0's hi, tile 1's hi, tile 0's lo, tile
// 1's lo, each in AMX's pair layout (row r holds k = 2r and 2r + 1 of the 16 columns, side by side). x is
// split the same way, per call, into hi and lo rows padded to 16.
//
// Only where GCC targets AMX-BF16 and AVX512-BF16 (-march=native on such a CPU) and Linux grants the
// process the tile state (`amx_usable`).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "float_math.h"
#include "float_tiles.h"
#include "huge_pages.h"
#include "panel_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define STRATA_AMX 1
#endif

namespace strata_kernels {

constexpr int64_t kAmxTileColumns = 16;
constexpr int64_t kAmxItemColumns = 2 * kAmxTileColumns;
constexpr int64_t kAmxDepth = 32;                         // K per tile multiply (16 pairs)
constexpr int64_t kAmxBlockElements = 16 * kAmxDepth;      // one 1 KB tile of bfloat16
constexpr int64_t kAmxStepElements = 4 * kAmxBlockElements;  // an item's hi and lo tiles for 32 of K
constexpr int64_t kAmxStepBytes = kAmxStepElements * 2;

inline int64_t amx_padded_depth(int64_t K) { return (K + kAmxDepth - 1) / kAmxDepth * kAmxDepth; }

// Bytes of one item of a weight with K inputs: its hi and lo tiles for each 32 of the padded depth.
inline int64_t amx_item_bytes(int64_t K) { return amx_padded_depth(K) / kAmxDepth * kAmxStepBytes; }

// Items of a weight with N rows (a GLU's 2I rows give I outputs, 16 an item).
inline int64_t amx_item_count(int64_t N, bool glu) {
  return glu ? (N / 2 + kAmxTileColumns - 1) / kAmxTileColumns : (N + kAmxItemColumns - 1) / kAmxItemColumns;
}

// The weight row held by column c (0-31) of item g, or -1 for padding.
inline int64_t amx_item_row(int64_t g, int64_t c, int64_t N, bool glu) {
  if (!glu) {
    const int64_t n = g * kAmxItemColumns + c;
    return n < N ? n : -1;
  }
  const int64_t output = g * kAmxTileColumns + c % kAmxTileColumns;
  if (output >= N / 2) return -1;
  return c < kAmxTileColumns ? output : N / 2 + output;
}

// bfloat16 bits of v rounded to nearest even, and the float a bfloat16's bits stand for. Weights only;
// the per-call split of x uses AVX512-BF16's conversion, which rounds the same way.
inline uint16_t bfloat16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline float bfloat16_value(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// weight [N, K] float32, contiguous, as bf16x3 items: a 1-D bfloat16 tensor (items x padded K / 32 x 2048),
// read whole every step, so advised for huge pages as the float32 panels are.
inline at::Tensor pack_amx_panels(const at::Tensor& weight, bool glu) {
  const int64_t N = weight.size(0), K = weight.size(1), Kp = amx_padded_depth(K);
  const int64_t items = amx_item_count(N, glu), steps = Kp / kAmxDepth;
  at::Tensor packed =
      empty_huge_page_backed(items * steps * kAmxStepElements, weight.options().dtype(at::kBFloat16));
  const float* w = weight.data_ptr<float>();
  uint16_t* p = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kAmxItemColumns; ++c) {
        const int64_t row = amx_item_row(g, c, N, glu);
        const int64_t tile = c / kAmxTileColumns, column = c % kAmxTileColumns;
        for (int64_t k = 0; k < Kp; ++k) {
          const float v = row >= 0 && k < K ? w[row * K + k] : 0.0f;
          const uint16_t hi = bfloat16_bits(v), lo = bfloat16_bits(v - bfloat16_value(hi));
          uint16_t* step = p + (g * steps + k / kAmxDepth) * kAmxStepElements;
          const int64_t at = ((k % kAmxDepth) / 2 * kAmxTileColumns + column) * 2 + k % 2;
          step[tile * kAmxBlockElements + at] = hi;
          step[(2 + tile) * kAmxBlockElements + at] = lo;
        }
      }
    }
  });
  return packed;
}

// The weight [N, K] that `pack_amx_panels(weight, glu)` packed into `packed`, each value as hi + lo (within
// about 2^-16 of the original): for a reader of a weight whose items replaced it.
inline at::Tensor unpack_amx_panels(const at::Tensor& packed, int64_t N, int64_t K, bool glu) {
  const int64_t steps = amx_padded_depth(K) / kAmxDepth;
  at::Tensor weight = at::empty({N, K}, packed.options().dtype(at::kFloat));
  const uint16_t* p = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* w = weight.data_ptr<float>();
  at::parallel_for(0, amx_item_count(N, glu), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t c = 0; c < kAmxItemColumns; ++c) {
        const int64_t row = amx_item_row(g, c, N, glu);
        if (row < 0) continue;
        const int64_t tile = c / kAmxTileColumns, column = c % kAmxTileColumns;
        for (int64_t k = 0; k < K; ++k) {
          const uint16_t* step = p + (g * steps + k / kAmxDepth) * kAmxStepElements;
          const int64_t at = ((k % kAmxDepth) / 2 * kAmxTileColumns + column) * 2 + k % 2;
          w[row * K + k] =
              bfloat16_value(step[tile * kAmxBlockElements + at]) + bfloat16_value(step[(2 + tile) * kAmxBlockElements + at]);
        }
      }
    }
  });
  return weight;
}

#ifdef STRATA_AMX

// Whether this process may use the tile registers: Linux hands them out on request (arch_prctl), once.
inline bool amx_usable() {
  static const bool usable = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return usable;
}

// Every tile 16 rows of 64 bytes. Each thread configures its tiles for a call and releases them after.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure_tiles() {
  AmxTileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  // GCC may drop the stores to a struct that only the builtin reads.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// x [M, K] float32 as bfloat16 hi and lo rows [Mp, Kp] each (Mp = M rounded up to 16), zeros beyond.
inline void split_rows(const float* x, int64_t M, int64_t K, int64_t Mp, int64_t Kp, uint16_t* hi, uint16_t* lo) {
  at::parallel_for(0, Mp, 64, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < Kp; k += 16) {
        const __mmask16 valid = m < M && k < K ? static_cast<__mmask16>((1u << std::min<int64_t>(16, K - k)) - 1) : 0;
        const __m512 v = _mm512_maskz_loadu_ps(valid, x + m * K + k);
        const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
        const __m512 h_value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        const __m256i l = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(v, h_value)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + m * Kp + k), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + m * Kp + k), l);
      }
    }
  });
}

// The sums of one item for 16 rows of x into c[column tile][16][16], over the padded depth. hi and lo point
// at the tile's first row, `ld` bfloat16 apart. With a `stream`, each 32 of K also requests the next
// stretch of it into L2.
// One row tile a pass, 32 rows in two passes over the item (the second finds it in L2): both row tiles in
// one pass is a little faster on a quiet core but clearly slower where a neighbour shares the core's tile
// unit, and all eight tiles in one pass (no weight reloads) is slower still.
struct AmxStream {
  const char* here;       // where step 0's stretch starts (inside this item)
  int64_t switch_step;    // the first step whose stretch lies in the next item
  const char* next;       // the item this thread takes next, or null
};

// Tiles 6 and 7: the item's two column tiles from `b` (the hi or the lo blocks, side by side).
inline void amx_load_weight(const uint16_t* b) {
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + kAmxBlockElements, 64);
}

// Tile 4: 16 rows of x from `a` (`ld` apart), multiplied into the sums of both column tiles (tiles 0 and 2).
inline void amx_multiply(const uint16_t* a, int64_t ld) {
  _tile_loadd(4, a, ld * 2);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(2, 4, 7);
}

inline void amx_item_block(const uint16_t* hi, const uint16_t* lo, int64_t ld, const uint16_t* item, int64_t steps,
                           float* c, const AmxStream* stream) {
  _tile_zero(0);
  _tile_zero(2);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = item + s * kAmxStepElements;
    if (stream) {
      const char* from = s < stream->switch_step ? stream->here + s * kAmxStepBytes
                         : stream->next         ? stream->next + (s - stream->switch_step) * kAmxStepBytes
                                                : nullptr;
      if (from) {
        for (int64_t l = 0; l < kAmxStepBytes; l += 64) _mm_prefetch(from + l, _MM_HINT_T1);
      }
    }
    const uint16_t* a_hi = hi + s * kAmxDepth;
    const uint16_t* a_lo = lo + s * kAmxDepth;
    // hi x hi and lo x hi of the weight's hi tiles, then hi x lo.
    amx_load_weight(b);
    amx_multiply(a_hi, ld);
    amx_multiply(a_lo, ld);
    amx_load_weight(b + 2 * kAmxBlockElements);
    amx_multiply(a_hi, ld);
  }
  _tile_stored(0, c, 64);
  _tile_stored(2, c + 16 * 16, 64);
}

#endif  // STRATA_AMX

// One weight of an `amx_panel_gemm` call: its items (bfloat16 bits).
using AmxPanelWeight = PackedWeightView<uint16_t>;

// How far ahead of its reads a thread asks for the weight stream (into L2); half or twice the distance was
// no faster.
constexpr int64_t kAmxPrefetchBytes = 8192;

// out (rows `ldo` apart) = x [M, K] (contiguous, M and K at least 1) times each packed weight, in one
// parallel region, the threads claiming items one at a time (`claim_items`). With a GATE, each weight
// is a GLU MLP's [gate; up] packed as such and gives N / 2 values act(gate) * up.
template <GateActivation GATE = GateActivation::kNone>
inline void amx_panel_gemm(const float* x, int64_t M, int64_t K, const std::vector<AmxPanelWeight>& weights,
                           float* out, int64_t ldo, int64_t grain) {
#ifdef STRATA_AMX
  constexpr bool kGlu = GATE != GateActivation::kNone;
  const int64_t Kp = amx_padded_depth(K), Mp = (M + 15) / 16 * 16, steps = Kp / kAmxDepth;
  const int64_t item_bytes = amx_item_bytes(K);
  at::Tensor split = at::empty({2, Mp, Kp}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* hi = reinterpret_cast<uint16_t*>(split.data_ptr());
  uint16_t* lo = hi + Mp * Kp;
  split_rows(x, M, K, Mp, Kp, hi, lo);
  const WeightParts owners(weights, [](const AmxPanelWeight& w) { return amx_item_count(w.N, kGlu); });
  const int64_t items = owners.total();
  const auto compute_item = [&](int64_t item, int64_t following) {
    const auto [i, g] = owners.locate(item);
    const AmxPanelWeight& w = weights[i];
    const uint16_t* panel = w.data + g * steps * kAmxStepElements;
    // The stream runs kAmxPrefetchBytes ahead of the reads, on into the item this thread takes next.
    AmxStream stream{reinterpret_cast<const char*>(panel) + kAmxPrefetchBytes,
                     std::max<int64_t>(0, (item_bytes - kAmxPrefetchBytes) / kAmxStepBytes), nullptr};
    if (following < items) {
      const auto [j, h] = owners.locate(following);
      stream.next = reinterpret_cast<const char*>(weights[j].data + h * steps * kAmxStepElements) +
                    std::max<int64_t>(0, kAmxPrefetchBytes - item_bytes);
    }
    alignas(64) float c[2][16][16];  // [column tile]
    const int64_t n0 = g * (kGlu ? kAmxTileColumns : kAmxItemColumns);
    const int64_t columns = std::min(kGlu ? kAmxTileColumns : kAmxItemColumns, (kGlu ? w.N / 2 : w.N) - n0);
    float* o = out + w.column + n0;
    for (int64_t r = 0; r < Mp; r += 16) {
      // The first row tile streams the next stretch in; the others find this item in L2.
      amx_item_block(hi + r * Kp, lo + r * Kp, Kp, panel, steps, c[0][0], r == 0 ? &stream : nullptr);
      for (int64_t m = r, row = 0; m < std::min(M, r + 16); ++m, ++row) {
        float* orow = o + m * ldo;
        if constexpr (kGlu) {
          NativeTile gate, up;
          std::memcpy(&gate, c[0][row], sizeof(gate));
          std::memcpy(&up, c[1][row], sizeof(up));
          static_assert(kNativeLanes == kAmxTileColumns, "an AMX build has AVX-512 registers");
          const NativeTile v = gate_activation<GATE>(gate) * up;
          std::memcpy(orow, &v, columns * sizeof(float));
        } else {
          for (int u = 0; u < 2; ++u) {
            const int64_t n = std::min<int64_t>(kAmxTileColumns, columns - u * kAmxTileColumns);
            if (n <= 0) break;
            NativeTile v, b = {};
            std::memcpy(&v, c[u][row], sizeof(v));
            if (w.bias) std::memcpy(&b, w.bias + n0 + u * kAmxTileColumns, n * sizeof(float));
            v += b;
            std::memcpy(orow + u * kAmxTileColumns, &v, n * sizeof(float));
          }
        }
      }
    }
  };
  claim_items(items, grain, items, compute_item, [](const auto& claim) {
    amx_configure_tiles();
    claim();
    _tile_release();
  });
#else
  (void)x, (void)M, (void)K, (void)weights, (void)out, (void)ldo, (void)grain;
  TORCH_CHECK(false, "strata_cpu: this build has no AMX kernel");
#endif
}

}  // namespace strata_kernels
