// Strata's float32 GEMM for inputs of several rows (batches of requests, prefill), on weights packed once
// into column panels: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// A panel holds kPanelColumns output columns of the weight, transposed: for each k, those columns' weights
// side by side ([K][kPanelColumns], the last panel only as wide as its columns rounded up to a tile). The
// micro-kernel keeps the sums of kPanelRows rows of x by the panel's columns in registers (8 x 3 tiles, 24 of
// the 32 AVX-512 registers) and, per k, loads the panel's 3 tiles once and multiplies them by each row's
// x[m, k]: 24 FMAs for 3 vector loads and 8 scalar broadcasts, and no horizontal sums. A thread reads a
// panel from memory once per chunk of rows, a slice of its depth at a time (`kSliceDepth`), and the other
// row blocks of the chunk find each slice in L1.
// It beats oneDNN on oneDNN's own prepacked layout at decode batches and small prefills, and runs close to
// the FMAs' rate with the weights in cache; at large prefills the two are about even.
//
// Only where a tile is one register (AVX-512): with AVX2's 16 registers of half a tile the same blocking
// would spill; `strata_cpu::linear` keeps oneDNN there.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "float_math.h"
#include "float_tiles.h"
#include "huge_pages.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata_kernels {

constexpr bool kHasPanelGemm = kNativeLanes == kLanes;
constexpr int kPanelTiles = 3;
constexpr int64_t kPanelColumns = kPanelTiles * kLanes;
constexpr int kPanelRows = 8;

// Rows of x per chunk: a chunk of x (rows x depth floats) stays in L2 beside the panel that its row blocks
// read in turn.
constexpr int64_t kChunkBytes = 256 * 1024;

// How much of K one pass over a panel's row blocks covers. Up to kMaxDepth, all of it: splitting a shallow
// panel only sends the sums out to memory and back between parts. Deeper panels do not stay in L2 for the
// next row block, and x's chunk shrinks to a few rows, which reads the weight again for every chunk: there
// parts of kDepthPart are faster than whole panels.
constexpr int64_t kMaxDepth = 2048;
constexpr int64_t kDepthPart = 1024;

// Columns [n0, n0 + columns) of a weight with K inputs start at n0 * K in the packed form (every panel
// before them is full), and are `panel_width(columns)` wide.
inline int64_t panel_width(int64_t columns) {
  return std::min<int64_t>(kPanelColumns, (columns + kLanes - 1) / kLanes * kLanes);
}

inline int64_t panel_count(int64_t N) { return (N + kPanelColumns - 1) / kPanelColumns; }

// The weight row that column j of the panel starting at column n0 (holding `columns` columns) reads. A GLU
// MLP's [gate; up] weight (N = 2I rows) is packed with each panel's outputs in pairs (`glu`): its first half
// holds gate rows n0 / 2 + j and its second half the up rows of the same outputs, so that the panel's sums
// give act(gate) * up for columns / 2 outputs without leaving registers and L1 (`panel_block`).
inline int64_t panel_row(int64_t n0, int64_t columns, int64_t j, int64_t N, bool glu) {
  if (!glu) return n0 + j;
  const int64_t half = columns / 2;
  return (j < half ? 0 : N / 2) + n0 / 2 + j % half;
}

// weight [N, K] float32, contiguous, as panels: a 1-D float32 tensor of N rounded up to a tile times K
// elements, the padding columns zero; read whole every step, so in memory advised for huge pages. With
// `glu` (N even), in gate and up pairs (`panel_row`).
inline at::Tensor pack_panels(const at::Tensor& weight, bool glu = false) {
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor packed = empty_huge_page_backed((N + kLanes - 1) / kLanes * kLanes * K, weight.options());
  const float* w = weight.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, panel_count(N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kPanelColumns, columns = std::min(kPanelColumns, N - n0);
      const int64_t width = panel_width(columns);
      float* panel = p + n0 * K;
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < width; ++j) {
          panel[k * width + j] = j < columns ? w[panel_row(n0, columns, j, N, glu) * K + k] : 0.0f;
        }
      }
    }
  });
  return packed;
}

// The weight [N, K] that `pack_panels(weight, glu)` packed into `packed`: the dense values, for a reader of
// a weight whose panels replaced it.
inline at::Tensor unpack_panels(const at::Tensor& packed, int64_t N, int64_t K, bool glu) {
  at::Tensor weight = at::empty({N, K}, packed.options());
  const float* p = packed.data_ptr<float>();
  float* w = weight.data_ptr<float>();
  at::parallel_for(0, panel_count(N), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kPanelColumns, columns = std::min(kPanelColumns, N - n0);
      const int64_t width = panel_width(columns);
      const float* panel = p + n0 * K;
      for (int64_t j = 0; j < columns; ++j) {
        float* row = w + panel_row(n0, columns, j, N, glu) * K;
        for (int64_t k = 0; k < K; ++k) row[k] = panel[k * width + j];
      }
    }
  });
  return weight;
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

// out[m, j] for MR rows of x (`ldx` apart) by one panel of TILES tiles over depth K, one slice of the
// item's depth (`sums`), of which the first `columns` columns are stored (rows of out `ldo` apart): bias
// added where given, or, with `accumulate`, the sums already in out (an earlier part of the depth) added
// instead. With a GATE, the panel holds gate and up pairs (`panel_row`) and out gets act(gate) * up,
// `columns / 2` values a row (no bias, whole depth). With PREFETCH, the first `prefetch.lines` cache lines
// from `prefetch.from` on are requested as well, one a k (more where there are more lines than k's), into L2,
// which is a little faster than into L1. A prefetch never faults, so one past the end of the weight is
// harmless.
struct Prefetch {
  const char* from;
  int64_t lines;
};

// Where a row block's sums come from and go to, the item's depth taken in slices (`kSliceDepth`): `carry`
// holds them between slices ([kPanelRows][kPanelTiles] tiles); the first slice starts them (zero, or out's
// with `accumulate`), the last one finishes them (bias, gate, store).
struct SliceSums {
  FloatTile* carry;
  bool first;
  bool last;
};

template <int MR, int TILES, bool PREFETCH, GateActivation GATE>
inline void panel_block(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias,
                        float* out, int64_t ldo, int64_t columns, bool accumulate, Prefetch prefetch,
                        SliceSums sums) {
  FloatTile acc[MR][TILES];
  STRATA_UNROLL
  for (int t = 0; t < TILES; ++t) {
    const int64_t n = std::min<int64_t>(kLanes, columns - t * kLanes);
    STRATA_UNROLL
    for (int m = 0; m < MR; ++m) {
      if (!sums.first) {
        std::memcpy(&acc[m][t], sums.carry + m * kPanelTiles + t, sizeof(FloatTile));
      } else {
        acc[m][t] = accumulate && n > 0 ? load_columns(out + m * ldo + t * kLanes, n) : FloatTile{};
      }
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PREFETCH) {
      for (int64_t line = k; line < prefetch.lines; line += K) __builtin_prefetch(prefetch.from + line * 64, 0, 2);
    }
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
  if (!sums.last) {
    STRATA_UNROLL
    for (int m = 0; m < MR; ++m) {
      STRATA_UNROLL
      for (int t = 0; t < TILES; ++t) std::memcpy(sums.carry + m * kPanelTiles + t, &acc[m][t], sizeof(FloatTile));
    }
    return;
  }
  if constexpr (GATE != GateActivation::kNone) {
    if constexpr (TILES == 3 && kNativeLanes == kLanes) {
      if (columns == kPanelColumns) {
        // A whole panel: gates 0-23 are tile 0 and the low half of tile 1, their ups the high half of tile 1
        // and tile 2. The ups are gathered by lane shuffles in registers: through memory, a load across two
        // tiles' stores waits for both to retire (no store forwarding).
        constexpr int kHalf = kLanes / 2;
        STRATA_UNROLL
        for (int m = 0; m < MR; ++m) {
          const FloatTile up_low = __builtin_shufflevector(acc[m][1], acc[m][2], 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                                           17, 18, 19, 20, 21, 22, 23);
          const FloatTile up_high = __builtin_shufflevector(acc[m][2], acc[m][2], 8, 9, 10, 11, 12, 13, 14, 15, 8,
                                                            9, 10, 11, 12, 13, 14, 15);
          const FloatTile low = gate_activation<GATE>(acc[m][0]) * up_low;
          const FloatTile high = gate_activation<GATE>(acc[m][1]) * up_high;
          std::memcpy(out + m * ldo, &low, sizeof(low));
          std::memcpy(out + m * ldo + kLanes, &high, kHalf * sizeof(float));
        }
        return;
      }
    }
    // Each row's sums go through L1 (a tile past the columns for the up half's last loads), and the rows'
    // activations are computed side by side: one row's exp and division alone is a chain of dependent
    // operations, MR of them interleave.
    alignas(64) float sums[MR][(TILES + 1) * kLanes];
    STRATA_UNROLL
    for (int m = 0; m < MR; ++m) {
      STRATA_UNROLL
      for (int t = 0; t < TILES; ++t) std::memcpy(sums[m] + t * kLanes, &acc[m][t], sizeof(FloatTile));
      std::memset(sums[m] + TILES * kLanes, 0, kLanes * sizeof(float));
    }
    const int64_t half = columns / 2;
    for (int64_t j = 0; j < half; j += kNativeLanes) {
      const int64_t n = std::min<int64_t>(kNativeLanes, half - j);
      STRATA_UNROLL
      for (int m = 0; m < MR; ++m) {
        NativeTile gate, up;
        std::memcpy(&gate, sums[m] + j, sizeof(gate));
        std::memcpy(&up, sums[m] + half + j, sizeof(up));
        const NativeTile v = gate_activation<GATE>(gate) * up;
        std::memcpy(out + m * ldo + j, &v, n * sizeof(float));
      }
    }
    return;
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

template <int TILES, bool PREFETCH, GateActivation GATE>
inline void panel_block_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                             const float* bias, float* out, int64_t ldo, int64_t columns, bool accumulate,
                             Prefetch prefetch, SliceSums sums) {
  switch (rows) {
    case 8: panel_block<8, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    case 7: panel_block<7, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    case 6: panel_block<6, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    case 5: panel_block<5, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    case 4: panel_block<4, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    case 3: panel_block<3, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    case 2: panel_block<2, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
    default: panel_block<1, TILES, PREFETCH, GATE>(x, ldx, panel, K, bias, out, ldo, columns, accumulate, prefetch, sums); break;
  }
}

// panel_block for a panel `width` columns wide (whole tiles) and 1 to kPanelRows rows.
template <bool PREFETCH, GateActivation GATE>
inline void panel_block_any(int64_t width, int rows, const float* x, int64_t ldx, const float* panel, int64_t K,
                            const float* bias, float* out, int64_t ldo, int64_t columns, bool accumulate,
                            Prefetch prefetch, SliceSums sums) {
  const auto block = [&](auto tiles) {
    panel_block_rows<decltype(tiles)::value, PREFETCH, GATE>(rows, x, ldx, panel, K, bias, out, ldo, columns, accumulate,
                                                       prefetch, sums);
  };
  switch (width / kLanes) {
    case 3: block(std::integral_constant<int, 3>{}); break;
    case 2: block(std::integral_constant<int, 2>{}); break;
    default: block(std::integral_constant<int, 1>{}); break;
  }
}

static_assert(kPanelRows == 8 && kPanelTiles == 3, "panel_block_rows and panel_block_any dispatch on these");

// One packed weight of a GEMM call (T: the packed elements): its outputs go to columns [column, column + N)
// of out (N / 2 of them for a GLU's [gate; up]).
template <typename T>
struct PackedWeightView {
  const T* data;
  const float* bias;  // [N] or null
  int64_t N;
  int64_t column;
};
using PanelWeight = PackedWeightView<float>;

// How much of the depth a work item's row blocks take in turn. An item (a chunk of rows by one panel) runs
// slice by slice: each row block multiplies a kSliceDepth-deep slice of the panel (12 KB of a full one),
// its sums carried in L1 from slice to slice (`SliceSums`), so the first block reads the slice from memory
// and the others from L1; and each slice's blocks request the slice after it into L2 (the first of the
// item this thread takes next, after the last), a share each, one cache line a k. The weight so streams in
// at an even pace while the FMAs run, where a block taking the whole depth would first wait on memory.
// Slices twice as deep, or prefetching two slices ahead, gain nothing; shallower or much deeper ones are slower.
constexpr int64_t kSliceDepth = 64;
// Items of fewer rows take their whole depth at once and prefetch nothing: at so few FMAs a k the hardware
// prefetcher keeps up, and slicing only adds overhead.
constexpr int64_t kMinStreamedRows = 4;
constexpr int64_t kBlockTiles = kPanelRows * kPanelTiles;

// This thread's room for the sums of `blocks` row blocks between slices.
inline FloatTile* slice_carry(int64_t blocks) {
  thread_local std::vector<FloatTile> carry;
  if (static_cast<int64_t>(carry.size()) < blocks * kBlockTiles) carry.resize(blocks * kBlockTiles);
  return carry.data();
}

// The parts (panels, or bf16x3 items) of a GEMM call's weights, numbered weight after weight: weight i owns
// parts [first[i], first[i + 1]).
class WeightParts {
 public:
  template <typename Weights, typename Count>
  WeightParts(const Weights& weights, const Count& parts_of) {
    for (const auto& w : weights) first_.push_back(first_.back() + parts_of(w));
  }

  int64_t total() const { return first_.back(); }

  // Part g's weight and its index among that weight's parts.
  std::pair<size_t, int64_t> locate(int64_t g) const {
    const size_t i = std::upper_bound(first_.begin(), first_.end(), g) - first_.begin() - 1;
    return {i, g - first_[i]};
  }

 private:
  std::vector<int64_t> first_{0};
};

// compute_item(item, following) for every item in [0, items), on as many of ATen's threads as give each
// `grain` of `range`: each thread claims items one at a time from a shared counter, one item ahead (the
// `following` one, whose weights it prefetches), so that a thread slowed by a neighbour takes fewer.
// `on_thread(claim)` runs a thread's claims (`claim()`) with whatever the thread sets up around them. Every
// call of the region claims until none are left, whatever range ATen hands it (a call after another, on
// the same thread, finds none).
template <typename Compute, typename OnThread>
inline void claim_items(int64_t range, int64_t grain, int64_t items, const Compute& compute_item,
                        const OnThread& on_thread) {
  std::atomic<int64_t> unclaimed{0};
  at::parallel_for(0, range, grain, [&](int64_t, int64_t) {
    on_thread([&] {
      for (int64_t item = unclaimed.fetch_add(1); item < items;) {
        const int64_t following = unclaimed.fetch_add(1);
        compute_item(item, following);
        item = following;
      }
    });
  });
}

// out (rows `ldo` apart) = x [M, K] (contiguous, M and K at least 1) times each packed weight: one parallel
// region for all of them (a layer's q, k and v projections in one call), on as many of ATen's threads as
// give each at least `grain` panels. The threads claim the panels one at a time rather than splitting them
// in equal ranges, so that one slowed by a neighbour takes fewer and the others do not wait for it at the
// end; where no thread is slowed, claiming costs nothing. With a GATE, each weight was packed in gate and up
// pairs (`pack_panels`, K at most kMaxDepth, no bias), and its N / 2 outputs are act(gate) * up.
template <GateActivation GATE = GateActivation::kNone>
inline void panel_gemm(const float* x, int64_t M, int64_t K, const std::vector<PanelWeight>& weights, float* out,
                       int64_t ldo, int64_t grain) {
  const WeightParts owners(weights, [](const PanelWeight& w) { return panel_count(w.N); });
  TORCH_CHECK(GATE == GateActivation::kNone || K <= kMaxDepth, "panel_gemm: a gated GEMM takes its whole depth");
  const int64_t depth = K <= kMaxDepth ? K : kDepthPart;
  const int64_t chunk_rows = std::max<int64_t>(kPanelRows, kChunkBytes / (depth * 4) / kPanelRows * kPanelRows);
  // Panel g's weight, its first column and how many of the weight's columns it holds.
  auto locate = [&](int64_t g) {
    const auto [i, panel] = owners.locate(g);
    const int64_t n0 = panel * kPanelColumns;
    return std::tuple{i, n0, std::min(kPanelColumns, weights[i].N - n0)};
  };
  // Work items are (chunk of rows, panel) pairs, chunk by chunk. Threads claim them in turn from a shared
  // counter, each one item ahead (the item after the one it computes, whose panel it prefetches).
  const int64_t panels = owners.total();
  const int64_t items = (M + chunk_rows - 1) / chunk_rows * panels;
  const auto compute_item = [&](int64_t item, int64_t following) {
    const int64_t m0 = item / panels * chunk_rows, m1 = std::min(M, m0 + chunk_rows);
    const int64_t blocks = (m1 - m0 + kPanelRows - 1) / kPanelRows;
    const auto [i, n0, columns] = locate(item % panels);
    const PanelWeight& w = weights[i];
    const int64_t width = panel_width(columns);
    const float* bias = w.bias ? w.bias + n0 : nullptr;
    float* o = out + w.column + (GATE == GateActivation::kNone ? n0 : n0 / 2);
    const bool streamed = m1 - m0 >= kMinStreamedRows;
    // Room for sums between slices, where there is more than one (a depth of at most kSliceDepth, which may
    // come with thousands of rows a chunk, has none).
    FloatTile* carry = streamed && depth > kSliceDepth ? slice_carry(blocks) : nullptr;
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const int64_t part = std::min(depth, K - k0);
      const float* panel = w.data + n0 * K + k0 * width;  // rows k0.. of the panel: contiguous
      const int64_t part_lines = part * width / kLanes;   // a tile is one cache line a k
      // What a streamed item's thread reads after this part of the panel: its next part, or the item it
      // takes next.
      const float* next = nullptr;
      int64_t next_lines = 0;
      if (streamed && k0 + depth < K) {
        next = panel + part * width;
        next_lines = std::min(depth, K - k0 - depth) * width / kLanes;
      } else if (streamed && following < items) {
        const auto [j, next_n0, next_columns] = locate(following % panels);
        next = weights[j].data + next_n0 * K;
        next_lines = std::min(depth, K) * panel_width(next_columns) / kLanes;
      }
      // `lines` cache lines from line `from` on of this thread's weight stream: this part, then `next`.
      const auto stretch = [&](int64_t from, int64_t lines) {
        if (from < part_lines) {
          return Prefetch{reinterpret_cast<const char*>(panel) + from * 64, std::min(lines, part_lines - from)};
        }
        from -= part_lines;
        if (from >= next_lines) return Prefetch{nullptr, 0};
        return Prefetch{reinterpret_cast<const char*>(next) + from * 64, std::min(lines, next_lines - from)};
      };
      const int64_t slice_depth = streamed ? kSliceDepth : part;
      const int64_t slices = (part + slice_depth - 1) / slice_depth, slice_lines = slice_depth * width / kLanes;
      const int64_t share = (slice_lines + blocks - 1) / blocks;  // lines a block prefetches
      for (int64_t s = 0; s < slices; ++s) {
        const int64_t ks = s * slice_depth;
        for (int64_t r = m0, block = 0; r < m1; r += kPanelRows, ++block) {
          const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, m1 - r));
          const SliceSums sums{carry + block * kBlockTiles, s == 0, s + 1 == slices};
          const auto run = [&](auto prefetching, Prefetch prefetch) {
            panel_block_any<decltype(prefetching)::value, GATE>(width, rows, x + r * K + k0 + ks, K, panel + ks * width,
                                                                std::min(slice_depth, part - ks), bias, o + r * ldo,
                                                                ldo, columns, k0 > 0, prefetch, sums);
          };
          if (streamed) {
            run(std::true_type{},
                stretch((s + 1) * slice_lines + block * share, std::min(share, slice_lines - block * share)));
          } else {
            run(std::false_type{}, {});
          }
        }
      }
    }
  };
  // ATen picks the threads for `grain` panels each.
  claim_items(panels, grain, items, compute_item, [](const auto& claim) { claim(); });
}

}  // namespace strata_kernels
