// Strata's float32 GEMM for inputs of several rows (batches of requests, prefill), on weights packed once
// into column panels: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// A panel holds kPanelColumns output columns of the weight, transposed: for each k, those columns' weights
// side by side ([K][kPanelColumns], the last panel only as wide as its columns rounded up to a tile). The
// micro-kernel keeps the sums of kPanelRows rows of x by the panel's columns in registers (8 x 3 tiles, 24 of
// the 32 AVX-512 registers) and, per k, loads the panel's 3 tiles once and multiplies them by each row's
// x[m, k]: 24 FMAs for 3 vector loads and 8 scalar broadcasts, and no horizontal sums. Each thread owns a
// range of panels: it reads its share of the weight from memory once per chunk of rows, and the other row
// blocks of the chunk find the panel in L2.
// Against oneDNN on its own prepacked layout (SmolLM-135M's 30 layers and head, weights read from memory,
// 2 threads, Zen 4 EPYC, whose FMAs allow 117 GFLOP/s a thread): 1.4-1.5x at 9 rows, 1.2-1.3x at 32
// (193-204 against 155-160 GFLOP/s), 1.1-1.2x at 64-128, 0.94-1.03x at 512-1024. With the weights in L3 it
// runs at 97% of the FMAs' rate, from memory at 82-87%; software prefetches of the next panel into L2
// during the current one's row blocks (0.98-1.03x) or ahead within the first row block (0.96-1.00x) did
// not close that gap, so there are none.
//
// Only where a tile is one register (AVX-512): with AVX2's 16 registers of half a tile the same blocking
// would spill, and no AVX2 machine was measured; `strata_cpu::linear` keeps oneDNN there.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "float_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace strata_kernels {

constexpr bool kHasPanelGemm = kNativeLanes == kLanes;
constexpr int kPanelTiles = 3;
constexpr int64_t kPanelColumns = kPanelTiles * kLanes;
constexpr int kPanelRows = 8;

// Rows of x per chunk: a chunk of x (rows x depth floats) stays in L2 beside the panel that its row blocks
// read in turn.
constexpr int64_t kChunkBytes = 256 * 1024;

// How much of K one pass over a panel's row blocks covers. Up to kMaxDepth, all of it: splitting SmolLM's
// K = 576 and 1536 into parts of 256 cost 1.06x at 32 rows (the sums go out to memory and back between
// parts), of 128 1.13x. Deeper panels (Llama-7B's K = 4096 and 11008: 2 MB and more for 48 columns) do not
// stay in L2 for the next row block, and x's chunk shrinks to a few rows, which reads the weight again for
// every chunk: there parts of 1024 ran 1.04x (32 rows) to 1.09x (128 rows) faster than whole panels.
constexpr int64_t kMaxDepth = 2048;
constexpr int64_t kDepthPart = 1024;

// Columns [n0, n0 + columns) of a weight with K inputs start at n0 * K in the packed form (every panel
// before them is full), and are `panel_width(columns)` wide.
inline int64_t panel_width(int64_t columns) {
  return std::min<int64_t>(kPanelColumns, (columns + kLanes - 1) / kLanes * kLanes);
}

inline int64_t panel_count(int64_t N) { return (N + kPanelColumns - 1) / kPanelColumns; }

// weight [N, K] float32, contiguous, as panels: a 1-D float32 tensor of N rounded up to a tile times K
// elements, the padding columns zero.
inline at::Tensor pack_panels(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor packed = at::empty({(N + kLanes - 1) / kLanes * kLanes * K}, weight.options());
  const float* w = weight.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, panel_count(N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kPanelColumns, columns = std::min(kPanelColumns, N - n0);
      const int64_t width = panel_width(columns);
      float* panel = p + n0 * K;
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < width; ++j) panel[k * width + j] = j < columns ? w[(n0 + j) * K + k] : 0.0f;
      }
    }
  });
  return packed;
}

// The first n (at most kLanes) floats at p as a tile, the others zero. A whole tile is one load; element by
// element into an accumulator, GCC would keep the accumulators in memory for the whole block.
inline FloatTile load_columns(const float* p, int64_t n) {
  FloatTile v = {};
  if (n == kLanes) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int64_t j = 0; j < n; ++j) v[j] = p[j];
  }
  return v;
}

// out[m, j] for MR rows of x (`ldx` apart) by one panel of TILES tiles over depth K, of which the first
// `columns` columns are stored (rows of out `ldo` apart): bias added where given, or, with `accumulate`,
// the sums already in out (an earlier part of the depth) added instead.
template <int MR, int TILES>
inline void panel_block(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                        float* out, int64_t ldo, int64_t columns, bool accumulate) {
  FloatTile acc[MR][TILES];
  STRATA_UNROLL
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = std::min<int64_t>(kLanes, columns - t * kLanes);
    STRATA_UNROLL
    for (int m = 0; m < MR; ++m) {
      acc[m][t] = accumulate && n > 0 ? load_columns(out + m * ldo + t * kLanes, n) : FloatTile{};
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    FloatTile w[TILES];
    STRATA_UNROLL
    for (int t = 0; t < TILES; ++t) std::memcpy(&w[t], panel + (k * TILES + t) * kLanes, sizeof(FloatTile));
    STRATA_UNROLL
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + k];
      STRATA_UNROLL
      for (int t = 0; t < TILES; ++t) acc[m][t] += xv * w[t];
    }
  }
  STRATA_UNROLL
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = std::min<int64_t>(kLanes, columns - t * kLanes);
    if (n <= 0) break;
    const FloatTile b = bias && !accumulate ? load_columns(bias + t * kLanes, n) : FloatTile{};
    STRATA_UNROLL
    for (int m = 0; m < MR; ++m) {
      const FloatTile v = acc[m][t] + b;
      float* o = out + m * ldo + t * kLanes;
      if (n == kLanes) {
        std::memcpy(o, &v, sizeof(v));
      } else {
        for (int64_t j = 0; j < n; ++j) o[j] = v[j];
      }
    }
  }
}

template <int TILES>
inline void panel_block_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                             const float* bias, float* out, int64_t ldo, int64_t columns, bool accumulate) {
  switch (rows) {
    case 8: panel_block<8, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    case 7: panel_block<7, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    case 6: panel_block<6, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    case 5: panel_block<5, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    case 4: panel_block<4, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    case 3: panel_block<3, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    case 2: panel_block<2, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
    default: panel_block<1, TILES>(x, ldx, panel, K, bias, out, ldo, columns, accumulate); break;
  }
}

static_assert(kPanelRows == 8 && kPanelTiles == 3, "panel_block_rows and panel_gemm dispatch on these");

// One packed weight of a `panel_gemm` call: its outputs go to columns [column, column + N) of out.
struct PanelWeight {
  const float* panels;
  const float* bias;  // [N] or null
  int64_t N;
  int64_t column;
};

// out (rows `ldo` apart) = x [M, K] (contiguous, M and K at least 1) times each packed weight, its panels
// split over ATen's threads, at least `grain` panels a thread: one parallel region for all of them (a
// layer's q, k and v projections in one call).
inline void panel_gemm(const float* x, int64_t M, int64_t K, const std::vector<PanelWeight>& weights, float* out,
                       int64_t ldo, int64_t grain) {
  std::vector<int64_t> first_panel{0};  // weight i owns panels [first_panel[i], first_panel[i + 1])
  for (const auto& w : weights) first_panel.push_back(first_panel.back() + panel_count(w.N));
  const int64_t depth = K <= kMaxDepth ? K : kDepthPart;
  const int64_t chunk_rows = std::max<int64_t>(kPanelRows, kChunkBytes / (depth * 4) / kPanelRows * kPanelRows);
  at::parallel_for(0, first_panel.back(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
      const int64_t m1 = std::min(M, m0 + chunk_rows);
      size_t i = 0;
      for (int64_t g = begin; g < end; ++g) {
        while (g >= first_panel[i + 1]) ++i;
        const PanelWeight& w = weights[i];
        const int64_t n0 = (g - first_panel[i]) * kPanelColumns, columns = std::min(kPanelColumns, w.N - n0);
        const int64_t width = panel_width(columns);
        const float* bias = w.bias ? w.bias + n0 : nullptr;
        float* o = out + w.column + n0;
        for (int64_t k0 = 0; k0 < K; k0 += depth) {
          const int64_t part = std::min(depth, K - k0);
          const float* panel = w.panels + n0 * K + k0 * width;  // rows k0.. of the panel: contiguous
          for (int64_t r = m0; r < m1; r += kPanelRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, m1 - r));
            const float* xr = x + r * K + k0;
            float* orow = o + r * ldo;
            switch (width / kLanes) {
              case 3: panel_block_rows<3>(rows, xr, K, panel, part, bias, orow, ldo, columns, k0 > 0); break;
              case 2: panel_block_rows<2>(rows, xr, K, panel, part, bias, orow, ldo, columns, k0 > 0); break;
              default: panel_block_rows<1>(rows, xr, K, panel, part, bias, orow, ldo, columns, k0 > 0); break;
            }
          }
        }
      }
    }
  });
}

}  // namespace strata_kernels
