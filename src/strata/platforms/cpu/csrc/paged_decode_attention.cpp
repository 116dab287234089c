// Strata's CPU decode attention: one query token per sequence attends over its paged KV cache in place.
// Also the cache write every attention layer does first (`write_kv_cache`).
//
// The pure-PyTorch decode path copies every sequence's blocks into a padded tensor (`k_cache[block_tables]`)
// per layer per step and then runs a handful of batched ops over the copy; for a small model that copy and
// the op overheads are a large share of a decode step. This kernel walks each sequence's block table and
// reads the keys and values where they lie, with a block-wise online softmax in float32, so each cached
// byte is read once and nothing is allocated per token.
//
// Work items are (sequence, KV head) pairs spread over ATen's intra-op threads, each thread a run of items
// with an equal share of the tokens to read (`balanced_runs`). The query heads that share a KV head (GQA)
// are computed together, so each key and value row serves all of them from L1. When there are too few items
// to keep every thread busy (a batch of one), each sequence's context is also split into parts of at least
// 256 tokens, attended separately and merged by their softmax sums, as flash-decoding does; so is a context
// much longer than the others' (`plan_work`).
//
// C++ (`#pragma omp simd` loops and GCC/Clang vector types; only the widening loads of `float_tiles.h` use
// x86 intrinsics where the CPU has them) vectorised by the compiler for this CPU (-O3 -march=native); it is
// built by `kernels.py`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "float_math.h"
#include "float_rows.h"
#include "float_tiles.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

// Columns per register tile: one native vector register (`float_tiles.h`), whose shuffles and lane sums
// compile to whole-register instructions on every CPU.
constexpr int64_t kTile = strata_kernels::kNativeLanes;

using Tile = strata_kernels::NativeTile;

// Calls f(heads, g) for the query heads [g, g + heads) of a GQA group, four at a time and the rest last,
// with `heads` a compile-time constant (std::integral_constant) so each call runs a kernel unrolled for it.
template <typename F>
inline void for_head_groups(int64_t group, F&& f) {
  for (int64_t g = 0; g < group; g += 4) {
    switch (std::min<int64_t>(4, group - g)) {
      case 1: f(std::integral_constant<int, 1>{}, g); break;
      case 2: f(std::integral_constant<int, 2>{}, g); break;
      case 3: f(std::integral_constant<int, 3>{}, g); break;
      default: f(std::integral_constant<int, 4>{}, g); break;
    }
  }
}
using strata_kernels::lane_max;
using strata_kernels::lane_total;
using strata_kernels::load_native;
using strata_kernels::load_native_once;
using strata_kernels::exp_nonpositive;
using strata_kernels::native_lane_sums;

// Scores of keys [n rows, `key_stride` apart] against MG query heads (rows of q, `D` apart) into MG rows of
// `scores` (`bs` apart). Each dot product is summed in a register tile (each widened key tile serves all MG
// heads), and the tiles of kTile keys are reduced to their scores together (`native_lane_sums`).
template <int MG, typename T>
inline void block_scores(const float* q, int64_t D, const T* keys, int64_t key_stride, int64_t n,
                         float* scores, int64_t bs) {
  const int64_t tiled = D - D % kTile;
  Tile dots[MG][kTile];
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t m = std::min(kTile, n - t0);
    for (int64_t t = 0; t < m; ++t) {
      const T* key = keys + (t0 + t) * key_stride;
      Tile a[MG] = {};
      for (int64_t d0 = 0; d0 < tiled; d0 += kTile) {
        const Tile k = load_native(key + d0);
        for (int g = 0; g < MG; ++g) a[g] += load_native(q + g * D + d0) * k;
      }
      for (int g = 0; g < MG; ++g) {
        for (int64_t d = tiled; d < D; ++d) a[g][0] += q[g * D + d] * widen(key[d]);
        dots[g][t] = a[g];
      }
    }
    for (int g = 0; g < MG; ++g) {
      std::fill(dots[g] + m, dots[g] + kTile, Tile{});
      const Tile sums = native_lane_sums(dots[g]);
      std::memcpy(scores + g * bs + t0, &sums, m * sizeof(float));
    }
  }
}

// acc[g] += sum_t p[g][t] * values[t] for MG heads (p rows `bs` apart, acc rows `Dv` apart). The value
// dimension goes in tiles of kTile whose sums stay in registers across the block's tokens; each widened
// value element serves all MG heads. The last Dv % kTile columns are summed in memory.
template <int MG, typename T>
inline void block_values(const float* p, int64_t bs, const T* values, int64_t value_stride, int64_t n,
                         float* acc, int64_t Dv) {
  int64_t d0 = 0;
  for (; d0 + kTile <= Dv; d0 += kTile) {
    float a[MG][kTile];
    for (int g = 0; g < MG; ++g) {
#pragma omp simd
      for (int64_t d = 0; d < kTile; ++d) a[g][d] = acc[g * Dv + d0 + d];
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* v = values + t * value_stride + d0;
      for (int g = 0; g < MG; ++g) {
        const float pt = p[g * bs + t];
#pragma omp simd
        for (int64_t d = 0; d < kTile; ++d) a[g][d] += pt * widen(v[d]);
      }
    }
    for (int g = 0; g < MG; ++g) {
#pragma omp simd
      for (int64_t d = 0; d < kTile; ++d) acc[g * Dv + d0 + d] = a[g][d];
    }
  }
  if (d0 == Dv) return;
  for (int64_t t = 0; t < n; ++t) {
    const T* v = values + t * value_stride;
    for (int g = 0; g < MG; ++g) {
      const float pt = p[g * bs + t];
      float* ag = acc + g * Dv;
#pragma omp simd
      for (int64_t d = d0; d < Dv; ++d) ag[d] += pt * widen(v[d]);
    }
  }
}

struct Shape {
  int64_t heads, kv_heads, head_dim, value_dim, block_size, num_blocks, max_blocks;
  int64_t k_strides[3], v_strides[3], table_stride;
  float scale, softcap;
  int64_t sliding_window;
};

// Reads entry `i` of an int32 or int64 index tensor: the engine builds block tables and lengths in either.
struct Indices {
  const int32_t* i32;
  const int64_t* i64;
  explicit Indices(const at::Tensor& t)
      : i32(t.scalar_type() == at::kInt ? t.data_ptr<int32_t>() : nullptr),
        i64(t.scalar_type() == at::kInt ? nullptr : t.data_ptr<int64_t>()) {}
  int64_t operator[](int64_t i) const { return i32 ? i32[i] : i64[i]; }
};

// How far ahead of the block being read a sequence's keys and values are asked into L2. Into L2, not L1: L1
// prefetches would hold the miss buffers the block's own loads need. A prefetch the memory system has no room
// for is dropped, so each line is asked for more than once. The tiled kernel asks, with each key it reads,
// for the same token's rows in the next `kStreamBlocks` blocks (one and two blocks ahead): the requests then
// come at the pace the memory serves them, where asking for a whole block at a time sends more requests at
// once than the miss queue holds. Other distances, or a third block ahead, did not help. The work loop asks
// for the next item's first kPrefetchBlocks blocks while the current item is computed, a block at a time:
// there the pace matters less than being early.
constexpr int kStreamBlocks = 2;
constexpr int64_t kPrefetchBlocks = 3;

// The first key and value of the KV head in block `index` of a sequence's `table`, as bytes; nulls where the
// context [0, len) does not reach that block or its id is invalid (an invalid one is reported where it is read).
template <typename T>
inline std::pair<const char*, const char*> block_rows(const Shape& s, const T* k, const T* v, Indices table,
                                                      int64_t index, int64_t len, int64_t kv_head) {
  if (index * s.block_size >= len) return {nullptr, nullptr};
  const int64_t id = table[index];
  if (id < 0 || id >= s.num_blocks) return {nullptr, nullptr};
  return {reinterpret_cast<const char*>(k + id * s.k_strides[0] + kv_head * s.k_strides[2]),
          reinterpret_cast<const char*>(v + id * s.v_strides[0] + kv_head * s.v_strides[2])};
}

// Prefetches into L2 the `key_bytes` of one token's key row at `key` and the `value_bytes` of its value row.
// Always inlined: where the caller's head dims are compile-time constants the line loops unroll (left rolled,
// they cost the tiled kernel more than the second block ahead gains).
__attribute__((always_inline)) inline void prefetch_rows(const char* key, const char* value, int64_t key_bytes,
                                                         int64_t value_bytes) {
  for (int64_t c = 0; c < key_bytes; c += 64) __builtin_prefetch(key + c, 0, 2);
  for (int64_t c = 0; c < value_bytes; c += 64) __builtin_prefetch(value + c, 0, 2);
}

// Prefetches into L2 the keys and values of the KV head in block `index` of a sequence's `table` (`block_rows`).
template <typename T>
__attribute__((always_inline)) inline void prefetch_block(const Shape& s, const T* k, const T* v, Indices table,
                                                          int64_t index, int64_t len, int64_t kv_head,
                                                          int64_t key_bytes, int64_t value_bytes) {
  const auto [kb, vb] = block_rows(s, k, v, table, index, len, kv_head);
  if (!kb) return;
  const int64_t tokens = std::min(s.block_size, len - index * s.block_size);
  for (int64_t t = 0; t < tokens; ++t) {
    prefetch_rows(kb + t * s.k_strides[1] * sizeof(T), vb + t * s.v_strides[1] * sizeof(T), key_bytes, value_bytes);
  }
}

// One work item: `group` query heads `q` ([group, head_dim], already scaled) of one KV head attend over the
// sequence's keys at positions [first, len); the softmax-weighted values go to `acc` ([group, value_dim]),
// each head's largest score and sum of exponentials to `stats` ([group, 2]), which is what merging the
// items of one sequence's parts needs. `scores` holds [group, block_size] floats and `row_max`/`row_sum`
// `group` floats of scratch.
template <typename T>
void attend_one(const Shape& s, const T* k, const T* v, Indices table, int64_t first, int64_t len,
                int64_t kv_head, const float* q, float* acc, float* stats, float* scores, float* row_max,
                float* row_sum) {
  const int64_t group = s.heads / s.kv_heads, bs = s.block_size, D = s.head_dim, Dv = s.value_dim;
  std::fill(acc, acc + group * Dv, 0.f);
  std::fill(row_max, row_max + group, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + group, 0.f);
  for (int64_t block = first / bs; block * bs < len; ++block) {
    const int64_t id = table[block];
    TORCH_CHECK(id >= 0 && id < s.num_blocks, "strata_cpu::paged_decode_attention: block id ", id,
                " is outside the cache's ", s.num_blocks, " blocks");
    const int64_t t0 = std::max(first, block * bs) - block * bs;
    const int64_t t1 = std::min(len, (block + 1) * bs) - block * bs;
    const int64_t n = t1 - t0;
    const T* kb = k + id * s.k_strides[0] + kv_head * s.k_strides[2] + t0 * s.k_strides[1];
    const T* vb = v + id * s.v_strides[0] + kv_head * s.v_strides[2] + t0 * s.v_strides[1];
    for_head_groups(group, [&](auto heads, int64_t g) {
      block_scores<heads>(q + g * D, D, kb, s.k_strides[1], n, scores + g * bs, bs);
    });
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * bs;
      if (s.softcap > 0) {
        for (int64_t t = 0; t < n; ++t) sg[t] = std::tanh(sg[t] / s.softcap) * s.softcap;
      }
      float block_max = row_max[g];
#pragma omp simd reduction(max : block_max)
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
      // Earlier blocks were weighted against the old maximum: bring their sum and output to the new one.
      const float correction = exp_nonpositive(row_max[g] - block_max);
      row_max[g] = block_max;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = exp_nonpositive(sg[t] - block_max);
        sum += sg[t];
      }
      row_sum[g] = row_sum[g] * correction + sum;
      if (correction != 1.f) {
        float* ag = acc + g * Dv;
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) ag[d] *= correction;
      }
    }
    for_head_groups(group, [&](auto heads, int64_t g) {
      block_values<heads>(scores + g * bs, bs, vb, s.v_strides[1], n, acc + g * Dv, Dv);
    });
  }
  for (int64_t g = 0; g < group; ++g) {
    // An empty context (a zero-length padding row) attends to nothing: its output stays zero.
    const float inv = row_sum[g] > 0 ? 1.f / row_sum[g] : 0.f;
    float* ag = acc + g * Dv;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) ag[d] *= inv;
    stats[2 * g] = row_max[g];
    stats[2 * g + 1] = row_sum[g];
  }
}

// The fast path for head dims that are whole tiles (DT key tiles, DVT value tiles, both small): MG query
// heads walk the sequence's keys in chunks of up to kTile keys (one chunk per block at block size 16). Each
// chunk's MG score vectors (one lane per key, from `lane_sums`) stay in registers through the mask, soft-cap,
// max, exp and sum; the heads' queries and outputs are register tiles held across the whole sequence, and the
// next blocks' keys and values are prefetched into L2 while this one is computed (`kStreamBlocks`).
// The chunk's work is kept off long dependency chains, which otherwise bound this loop well below its
// instructions' throughput: each dot product sums its tiles in two halves, a chunk that does not raise a
// head's maximum (most of them, past the first few) rescales nothing, and the sums of the exponentials stay
// in a register tile until the end instead of being reduced across lanes every chunk. Each float32 value
// tile is loaded once for the group's heads (`load_native_once`), not once per head as GCC would.
template <int MG, int DT, int DVT, typename T>
void attend_tiles(const Shape& s, const T* k, const T* v, Indices table, int64_t first, int64_t len,
                  int64_t kv_head, const float* q, float* out, float* stats) {
  const int64_t bs = s.block_size, D = s.head_dim, Dv = s.value_dim;
  const int64_t ks = s.k_strides[1], vs = s.v_strides[1];
  constexpr int64_t kKeyBytes = DT * kTile * sizeof(T), kValueBytes = DVT * kTile * sizeof(T);
  const int64_t key_row = ks * sizeof(T), value_row = vs * sizeof(T);  // bytes from one token's rows to the next
  Tile qt[MG][DT];
  for (int g = 0; g < MG; ++g)
    for (int d = 0; d < DT; ++d) qt[g][d] = load_native(q + g * D + d * kTile);
  Tile acc[MG][DVT];
  for (int g = 0; g < MG; ++g)
    for (int d = 0; d < DVT; ++d) acc[g][d] = Tile{};
  float row_max[MG];
  Tile row_sums[MG];
  for (int g = 0; g < MG; ++g) {
    row_max[g] = -std::numeric_limits<float>::infinity();
    row_sums[g] = Tile{};
  }
  Tile lane;
  for (int j = 0; j < kTile; ++j) lane[j] = static_cast<float>(j);
  const Tile neg_inf = Tile{} - std::numeric_limits<float>::infinity();
  alignas(64) float p[MG][kTile];
  const int64_t first_block = first / bs;
  int64_t id = first_block * bs < len ? table[first_block] : 0;
  for (int64_t block = first_block; block * bs < len; ++block) {
    TORCH_CHECK(id >= 0 && id < s.num_blocks, "strata_cpu::paged_decode_attention: block id ", id,
                " is outside the cache's ", s.num_blocks, " blocks");
    // This block's keys and values for the KV head; chunk offsets below are positions in the block.
    const T* kb = k + id * s.k_strides[0] + kv_head * s.k_strides[2];
    const T* vb = v + id * s.v_strides[0] + kv_head * s.v_strides[2];
    const int64_t lo = std::max(first, block * bs) - block * bs;
    const int64_t hi = std::min(len, (block + 1) * bs) - block * bs;
    // The KV head's rows in the next kStreamBlocks blocks, asked for key by key below (`kStreamBlocks`).
    const char* ahead_keys[kStreamBlocks];
    const char* ahead_values[kStreamBlocks];
    for (int a = 0; a < kStreamBlocks; ++a) {
      std::tie(ahead_keys[a], ahead_values[a]) = block_rows(s, k, v, table, block + 1 + a, len, kv_head);
    }
    if ((block + 1) * bs < len) id = table[block + 1];
    for (int64_t c0 = lo; c0 < hi; c0 += kTile) {
      const int64_t n = std::min<int64_t>(kTile, hi - c0);
      Tile dots[MG][kTile];
      for (int64_t t = 0; t < n; ++t) {
        const T* key = kb + (c0 + t) * ks;
        for (int a = 0; a < kStreamBlocks; ++a) {
          if (ahead_keys[a]) {
            prefetch_rows(ahead_keys[a] + (c0 + t) * key_row, ahead_values[a] + (c0 + t) * value_row, kKeyBytes,
                          kValueBytes);
          }
        }
        Tile kt[DT];
        for (int d = 0; d < DT; ++d) kt[d] = load_native(key + d * kTile);
        for (int g = 0; g < MG; ++g) {
          Tile a[2] = {};
          for (int d = 0; d < DT; ++d) a[d % 2] += qt[g][d] * kt[d];
          dots[g][t] = a[0] + a[1];
        }
      }
      for (int64_t t = n; t < kTile; ++t)
        for (int g = 0; g < MG; ++g) dots[g][t] = Tile{};
      const auto valid = lane < static_cast<float>(n);
      for (int g = 0; g < MG; ++g) {
        Tile sc = native_lane_sums(dots[g]);
        if (s.softcap > 0) {
          for (int64_t t = 0; t < n; ++t) sc[t] = std::tanh(sc[t] / s.softcap) * s.softcap;
        }
        sc = valid ? sc : neg_inf;
        const float chunk_max = lane_max(sc)[0];
        if (chunk_max > row_max[g]) {
          const float correction = exp_nonpositive(row_max[g] - chunk_max);
          row_max[g] = chunk_max;
          row_sums[g] *= correction;
          for (int d = 0; d < DVT; ++d) acc[g][d] *= correction;
        }
        const Tile e = exp_nonpositive(sc - row_max[g]);
        std::memcpy(p[g], &e, sizeof(e));
        row_sums[g] += e;
      }
      for (int64_t t = 0; t < n; ++t) {
        const T* val = vb + (c0 + t) * vs;
        for (int d = 0; d < DVT; ++d) {
          const Tile vt = load_native_once(val + d * kTile);
          for (int g = 0; g < MG; ++g) acc[g][d] += p[g][t] * vt;
        }
      }
    }
  }
  for (int g = 0; g < MG; ++g) {
    const float row_sum = lane_total(row_sums[g])[0];
    // An empty context (a zero-length padding row) attends to nothing: its output stays zero.
    const float inv = row_sum > 0 ? 1.f / row_sum : 0.f;
    for (int d = 0; d < DVT; ++d) {
      const Tile r = acc[g][d] * inv;
      std::memcpy(out + g * Dv + d * kTile, &r, sizeof(r));
    }
    stats[2 * g] = row_max[g];
    stats[2 * g + 1] = row_sum;
  }
}

template <int DT, int DVT, typename T>
void attend_tiles_group(const Shape& s, const T* k, const T* v, Indices table, int64_t first, int64_t len,
                        int64_t kv_head, const float* q, float* out, float* stats) {
  const int64_t group = s.heads / s.kv_heads;
  for_head_groups(group, [&](auto heads, int64_t g) {
    attend_tiles<heads, DT, DVT>(s, k, v, table, first, len, kv_head, q + g * s.head_dim,
                                 out + g * s.value_dim, stats + 2 * g);
  });
}

// The fast path for this shape, or null.
template <typename T>
using AttendFn = void (*)(const Shape&, const T*, const T*, Indices, int64_t, int64_t, int64_t, const float*,
                          float*, float*);

template <int HeadDim, typename T>
AttendFn<T> tiles_for() {
  if constexpr (HeadDim % kTile == 0) return &attend_tiles_group<HeadDim / kTile, HeadDim / kTile, T>;
  return nullptr;
}

// The head dims of common models (48: TinyStories-sized Llamas; 80: Phi-2, StableLM; 96: Phi-3;
// 256: Gemma), each where it is whole tiles on this CPU.
template <typename T>
AttendFn<T> tiled_path(const Shape& s) {
  if (s.head_dim != s.value_dim) return nullptr;
  switch (s.head_dim) {
    case 32: return tiles_for<32, T>();
    case 48: return tiles_for<48, T>();
    case 64: return tiles_for<64, T>();
    case 80: return tiles_for<80, T>();
    case 96: return tiles_for<96, T>();
    case 128: return tiles_for<128, T>();
    case 256: return tiles_for<256, T>();
    default: return nullptr;
  }
}

// A sequence's context is split into parts (each its own work item, merged afterwards) of at least this many
// tokens: shorter parts cost more to merge than they save.
constexpr int64_t kMinPartTokens = 256;

// Part `part` of `parts` of the token span [first, len), cut at block boundaries.
std::pair<int64_t, int64_t> part_span(int64_t first, int64_t len, int64_t part, int64_t parts, int64_t bs) {
  if (parts == 1) return {first, len};
  const int64_t first_block = first / bs, blocks = (len + bs - 1) / bs - first_block;
  const int64_t lo = first_block + blocks * part / parts, hi = first_block + blocks * (part + 1) / parts;
  return {std::max(first, lo * bs), std::min(len, hi * bs)};
}

// out[g] = the softmax-weighted sum over all of a sequence's parts, from each part's normalised output and
// its (largest score, sum of exponentials) per head: each part counts in proportion to its share of the
// whole softmax's denominator.
void merge_parts(const float* part_out, const float* part_stats, int64_t parts, int64_t group, int64_t Dv,
                 float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) {
      const float* st = part_stats + (p * group + g) * 2;
      if (st[1] > 0) top = std::max(top, st[0]);
    }
    float* o = out + g * Dv;
    std::fill(o, o + Dv, 0.f);
    float total = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      const float* st = part_stats + (p * group + g) * 2;
      if (!(st[1] > 0)) continue;
      const float weight = st[1] * exp_nonpositive(st[0] - top);
      total += weight;
      const float* po = part_out + (p * group + g) * Dv;
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) o[d] += weight * po[d];
    }
    const float inv = total > 0 ? 1.f / total : 0.f;
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
  }
}

// A work item's fixed cost, in tokens of its KV head read: its setup takes about as long as reading this many
// tokens. Counted lower, the runs of short items come out too long.
constexpr int64_t kItemCostTokens = 16;

// Cuts work items into `threads` contiguous runs of about equal cost, from the items' running costs (cost[i]:
// items [0, i)): run t is [runs[t], runs[t + 1]).
std::vector<int64_t> balanced_runs(const std::vector<int64_t>& cost, int64_t threads) {
  const int64_t count = static_cast<int64_t>(cost.size()) - 1;
  std::vector<int64_t> runs(threads + 1, count);
  runs[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    // The cut nearest this run's share of the total, and never before the previous one.
    const int64_t share = cost.back() * t / threads;
    int64_t cut = std::lower_bound(cost.begin(), cost.end(), share) - cost.begin();
    if (cut > 0 && share - cost[cut - 1] < cost[cut] - share) --cut;
    runs[t] = std::max(runs[t - 1], cut);
  }
  return runs;
}

// How a step's attention is cut into work items and spread over the threads: sequence b's context in
// parts[b] parts, its items [item_start[b], item_start[b + 1]) (its KV heads in turn, each in its parts), the
// items' running costs (`balanced_runs`) and thread t's run of items [runs[t], runs[t + 1]).
struct WorkPlan {
  std::vector<int64_t> parts, item_start, cost, runs;

  WorkPlan(std::vector<int64_t> context_parts, const std::vector<int64_t>& firsts, const std::vector<int64_t>& lens,
           int64_t kv_heads, int64_t block_size, int64_t threads)
      : parts(std::move(context_parts)), item_start{0}, cost{0} {
    for (size_t b = 0; b < parts.size(); ++b) {
      item_start.push_back(item_start.back() + kv_heads * parts[b]);
      for (int64_t item = 0; item < kv_heads * parts[b]; ++item) {
        const auto [first, last] = part_span(firsts[b], lens[b], item % parts[b], parts[b], block_size);
        cost.push_back(cost.back() + last - first + kItemCostTokens);
      }
    }
    runs = balanced_runs(cost, std::min(threads, items()));
  }

  int64_t items() const { return item_start.back(); }
  int64_t threads() const { return static_cast<int64_t>(runs.size()) - 1; }
  // How far the costliest run is over an even share, in percent.
  int64_t excess_percent() const {
    int64_t costliest = 0;
    for (int64_t t = 0; t < threads(); ++t) costliest = std::max(costliest, cost[runs[t + 1]] - cost[runs[t]]);
    return threads() == 0 ? 0 : costliest * 100 * threads() / std::max<int64_t>(1, cost.back()) - 100;
  }
};

// Where the threads' runs of whole items come out more than this many percent over an even share (one long
// context among short ones: its KV heads' items can hold more than half the tokens), long contexts are split.
constexpr int64_t kRunExcessPercent = 5;
// Those contexts are cut into parts of at most a share of the tokens this many times smaller than a thread's.
constexpr int64_t kPartsPerThreadShare = 8;

// The plan for contexts [firsts[b], lens[b]). With fewer (sequence, KV head) items than twice the threads (a
// batch of one, whose few KV heads leave threads idle or unevenly loaded: 3 heads on 2 threads), every
// context in enough parts for two items per thread, so each thread reads whole stretches of the cache. With
// more, whole contexts while the runs come out even (`kRunExcessPercent`); else the contexts longer than an
// eighth of a thread's share of the tokens are cut into parts of at most that. Parts hold at least
// kMinPartTokens (and a block).
WorkPlan plan_work(const std::vector<int64_t>& firsts, const std::vector<int64_t>& lens, int64_t kv_heads,
                   int64_t block_size) {
  const int64_t threads = at::get_num_threads(), batch = static_cast<int64_t>(lens.size());
  const int64_t shortest_part = std::max(kMinPartTokens, block_size);
  std::vector<int64_t> spans(batch), parts(batch, 1);
  for (int64_t b = 0; b < batch; ++b) spans[b] = lens[b] - firsts[b];
  const auto at_most = [&](int64_t span, int64_t wanted) {
    return std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, span / shortest_part));
  };
  const int64_t items = batch * kv_heads;
  if (threads > 1 && items > 0 && items < 2 * threads) {
    const int64_t longest = *std::max_element(spans.begin(), spans.end());
    std::fill(parts.begin(), parts.end(), at_most(longest, (2 * threads + items - 1) / items));
  }
  WorkPlan whole(parts, firsts, lens, kv_heads, block_size, threads);
  if (threads <= 1 || items < 2 * threads || whole.excess_percent() <= kRunExcessPercent) return whole;
  int64_t tokens = 0;
  for (const int64_t span : spans) tokens += span * kv_heads;
  const int64_t longest_item = std::max(shortest_part, tokens / threads / kPartsPerThreadShare);
  for (int64_t b = 0; b < batch; ++b) parts[b] = at_most(spans[b], (spans[b] + longest_item - 1) / longest_item);
  return WorkPlan(parts, firsts, lens, kv_heads, block_size, threads);
}

// A step's keys and values to store (`StepRows`, with the cache writes below); store_newest stores row b's
// KV head `kv_head`.
struct StepRows;
void store_newest(const StepRows& rows, int64_t b, int64_t kv_head);

// The general path (`attend_one`) serves other head dims and value dims that differ from the key's. With
// `newest` (row b of it is sequence b's newest token), the item that reads a sequence's last token stores that
// token's key and value of its KV head first: the stores run on every thread instead of on one before the
// items, and the line each lands in is the one its item reads last.
template <typename T>
void decode_attention(const Shape& s, const float* query, const T* k, const T* v, const at::Tensor& tables,
                      const std::vector<int64_t>& lens, float* out, const StepRows* newest) {
  const int64_t group = s.heads / s.kv_heads, batch = static_cast<int64_t>(lens.size());
  const Indices table_all(tables);
  const AttendFn<T> tiled = tiled_path<T>(s);
  std::vector<int64_t> firsts(batch);
  for (int64_t b = 0; b < batch; ++b) {
    firsts[b] = s.sliding_window > 0 ? std::max<int64_t>(0, lens[b] - s.sliding_window) : 0;
  }
  // Each thread attends a contiguous run of work items holding about the same number of tokens as the
  // others' (`plan_work`). A split item's output and stats go to scratch and are merged below; the others',
  // straight to out.
  const WorkPlan plan = plan_work(firsts, lens, s.kv_heads, s.block_size);
  const std::vector<int64_t>& parts = plan.parts;
  const std::vector<int64_t>& item_start = plan.item_start;
  const int64_t items = plan.items();
  const bool any_split = items > batch * s.kv_heads;
  std::vector<float> part_out(any_split ? items * group * s.value_dim : 0);
  std::vector<float> stats(items * group * 2);
  // Work item `work`'s sequence, KV head, block table, token span and output.
  auto locate = [&](int64_t work) {
    const int64_t b = any_split ? std::upper_bound(item_start.begin(), item_start.end(), work) - item_start.begin() - 1
                                : work / s.kv_heads;
    const int64_t kv_head = (work - item_start[b]) / parts[b], part = (work - item_start[b]) % parts[b];
    Indices table = table_all;
    if (table.i32) table.i32 += b * s.table_stride;
    else table.i64 += b * s.table_stride;
    const auto [first, last] = part_span(firsts[b], lens[b], part, parts[b], s.block_size);
    float* o = parts[b] > 1 ? part_out.data() + work * group * s.value_dim
                            : out + (b * s.heads + kv_head * group) * s.value_dim;
    return std::tuple{b, kv_head, table, first, last, o};
  };
  const std::vector<int64_t>& runs = plan.runs;
  at::parallel_for(0, plan.threads(), 1, [&](int64_t first_run, int64_t end_run) {
    const int64_t begin = runs[first_run], end = runs[end_run];
    std::vector<float> q(group * s.head_dim), scores(group * s.block_size), row_max(group), row_sum(group);
    for (int64_t work = begin; work < end; ++work) {
      const auto [b, kv_head, table, first, last, o] = locate(work);
      if (work + 1 < end) {  // the next item's first blocks arrive while this one is computed
        const auto [next_b, next_head, next_table, next_first, next_last, next_o] = locate(work + 1);
        for (int64_t ahead = 0; ahead < kPrefetchBlocks; ++ahead)
          prefetch_block(s, k, v, next_table, next_first / s.block_size + ahead, next_last, next_head,
                         s.head_dim * sizeof(T), s.value_dim * sizeof(T));
      }
      if (newest && last == lens[b]) store_newest(*newest, b, kv_head);
      const float* qb = query + (b * s.heads + kv_head * group) * s.head_dim;
      for (int64_t i = 0; i < group * s.head_dim; ++i) q[i] = qb[i] * s.scale;
      float* st = stats.data() + work * group * 2;
      if (tiled) {
        tiled(s, k, v, table, first, last, kv_head, q.data(), o, st);
      } else {
        attend_one(s, k, v, table, first, last, kv_head, q.data(), o, st, scores.data(), row_max.data(),
                   row_sum.data());
      }
    }
  });
  for (int64_t b = 0; b < batch && any_split; ++b) {
    for (int64_t kv_head = 0; kv_head < s.kv_heads && parts[b] > 1; ++kv_head) {
      const int64_t work = item_start[b] + kv_head * parts[b];
      merge_parts(part_out.data() + work * group * s.value_dim, stats.data() + work * group * 2, parts[b], group,
                  s.value_dim, out + (b * s.heads + kv_head * group) * s.value_dim);
    }
  }
}

// Keys or values of a layer's cache, [num_blocks, block_size, kv_heads, dim]: a 4-D tensor, or one half of the
// engine's [2, num_blocks, block_size, kv_heads, dim] cache, read through its pointer and strides. A `select`
// view of each half would cost a tensor per call, two a layer every decode step.
struct CacheHalf {
  char* data;
  at::ScalarType dtype;
  int64_t itemsize;
  std::array<int64_t, 4> sizes, strides;

  static CacheHalf of(const at::Tensor& cache, int64_t first_dim = 0, int64_t offset = 0) {
    CacheHalf half{static_cast<char*>(cache.data_ptr()) + offset * cache.element_size(), cache.scalar_type(),
                   static_cast<int64_t>(cache.element_size()), {}, {}};
    for (int d = 0; d < 4; ++d) {
      half.sizes[d] = cache.size(first_dim + d);
      half.strides[d] = cache.stride(first_dim + d);
    }
    return half;
  }
  // Half `index` (0: keys, 1: values) of a [2, ...] cache.
  static CacheHalf of_pair(const at::Tensor& kv_cache, int64_t index) {
    return of(kv_cache, 1, index * kv_cache.stride(0));
  }

  bool same_blocks(const CacheHalf& other, int dims) const {
    return std::equal(sizes.begin(), sizes.begin() + dims, other.sizes.begin());
  }
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data);
  }
};

std::ostream& operator<<(std::ostream& out, const CacheHalf& half) {
  return out << at::IntArrayRef(half.sizes.data(), half.sizes.size());
}

// Whether each token's [Hkv, D] of `rows` lies contiguously in memory, whatever the stride between tokens.
bool token_rows_contiguous(const at::Tensor& rows) {
  return (rows.size(2) <= 1 || rows.stride(2) == 1) && (rows.size(1) <= 1 || rows.stride(1) == rows.size(2));
}

// Rounds n float32 values into a 16-bit cache's dtype as `to()` does (to nearest, ties to even).
template <typename T>
void narrow_into(char* to, const char* from, int64_t n) {
  const float* source = reinterpret_cast<const float*>(from);
  T* target = reinterpret_cast<T*>(to);
  for (int64_t i = 0; i < n; ++i) target[i] = static_cast<T>(source[i]);
}

// `rows` [T, Hkv, D] (any floating dtype) as `store_heads` reads them for `cache`: rows in the cache's dtype,
// or float32 rows for a 16-bit cache, where they lie (rounded when stored). A decode step's values are a
// strided view of the layer's fused q/k/v projection, and a contiguous or converted copy of them first cost
// a tensor per layer. Other rows are converted here.
at::Tensor cache_rows(const char* op, const at::Tensor& rows, const CacheHalf& cache, int64_t tokens) {
  TORCH_CHECK(rows.dim() == 3, op, "rows must be [tokens, kv_heads, head_dim], got ", rows.sizes());
  TORCH_CHECK(rows.size(0) == tokens && rows.size(1) == cache.sizes[2] && rows.size(2) == cache.sizes[3], op,
              "rows ", rows.sizes(), " do not fit slot_mapping [", tokens, "] and cache ", cache);
  TORCH_CHECK(cache.strides[3] == 1 && cache.strides[2] == cache.sizes[3], op,
              "each cache slot must hold its heads contiguously");
  const bool narrows = rows.scalar_type() == at::kFloat && (cache.dtype == at::kBFloat16 || cache.dtype == at::kHalf);
  const bool in_place = (rows.scalar_type() == cache.dtype || narrows) && token_rows_contiguous(rows);
  return in_place ? rows : rows.to(cache.dtype).contiguous();
}

// Copies KV heads [head, head + heads) of token t of `src` (`cache_rows`) to the flat slot `slot` (block *
// block_size + offset, checked by the caller) of `cache` [num_blocks, block_size, Hkv, D].
void store_heads(const CacheHalf& cache, const at::Tensor& src, int64_t t, int64_t slot, int64_t head,
                 int64_t heads) {
  const int64_t block_size = cache.sizes[1], elements = heads * src.size(2);
  char* to = cache.data + ((slot / block_size) * cache.strides[0] + (slot % block_size) * cache.strides[1] +
                           head * cache.strides[2]) * cache.itemsize;
  const char* from = static_cast<const char*>(src.const_data_ptr()) +
                     (t * src.stride(0) + head * src.stride(1)) * src.element_size();
  if (src.scalar_type() == cache.dtype) {
    std::memcpy(to, from, elements * cache.itemsize);
  } else if (cache.dtype == at::kHalf) {
    narrow_into<c10::Half>(to, from, elements);
  } else {
    narrow_into<c10::BFloat16>(to, from, elements);
  }
}

// A step's keys [T, Hkv, D] and values [T, Hkv, Dv] with their flat slots [T], checked (every slot before
// anything is stored) and ready to store into the key and value halves of a cache.
struct StepRows {
  CacheHalf k, v;
  at::Tensor slots, keys, values;
  Indices slot_at;

  StepRows(const char* op, const at::Tensor& key, const at::Tensor& value, const CacheHalf& k_cache,
           const CacheHalf& v_cache, const at::Tensor& slot_mapping)
      : k(k_cache),
        v(v_cache),
        slots(checked_slots(op, slot_mapping, k_cache, v_cache)),
        keys(cache_rows(op, key, k_cache, slots.size(0))),
        values(cache_rows(op, value, v_cache, slots.size(0))),
        slot_at(slots) {}

  int64_t tokens() const { return slots.size(0); }
  // Token t's key and value rows of KV heads [head, head + heads).
  void store(int64_t t, int64_t head, int64_t heads) const {
    store_heads(k, keys, t, slot_at[t], head, heads);
    store_heads(v, values, t, slot_at[t], head, heads);
  }
  void store_all() const {
    for (int64_t t = 0; t < tokens(); ++t) store(t, 0, k.sizes[2]);
  }

 private:
  static at::Tensor checked_slots(const char* op, const at::Tensor& slot_mapping, const CacheHalf& k,
                                  const CacheHalf& v) {
    TORCH_CHECK(slot_mapping.dim() == 1 &&
                    (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
                op, "slot_mapping must be a 1-D int32 or int64 tensor");
    TORCH_CHECK(k.same_blocks(v, 2), op,
                "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] with one block layout");
    at::Tensor slots = slot_mapping.contiguous();
    const int64_t capacity = k.sizes[0] * k.sizes[1];
    const Indices slot_at(slots);
    for (int64_t t = 0; t < slots.size(0); ++t) {
      TORCH_CHECK(slot_at[t] >= 0 && slot_at[t] < capacity, op, "slot ", slot_at[t], " of token ", t,
                  " is outside the cache's ", capacity, " slots");
    }
    return slots;
  }
};

void store_newest(const StepRows& rows, int64_t b, int64_t kv_head) { rows.store(b, kv_head, 1); }

// Whether row b of a step's keys is sequence b's newest token, at position lens[b] - 1 of its own block table,
// for every b (a decode step): then no sequence reads another's new row, and each work item can store its own.
bool rows_are_newest_tokens(const StepRows& rows, const at::Tensor& tables, const std::vector<int64_t>& lens,
                            int64_t block_size) {
  if (rows.tokens() != static_cast<int64_t>(lens.size())) return false;
  const Indices table_at(tables);
  for (int64_t b = 0; b < rows.tokens(); ++b) {
    if (lens[b] < 1) return false;
    const int64_t position = lens[b] - 1;
    const int64_t block = table_at[b * tables.stride(0) + position / block_size];
    if (rows.slot_at[b] != block * block_size + position % block_size) return false;
  }
  return true;
}

// paged_decode_attention on caches given as halves (`CacheHalf`), each head's values contiguous. With
// `step`, this step's keys and values are stored first: by the work items themselves where each row is its
// sequence's newest token (`rows_are_newest_tokens`), else all of them before any item starts.
at::Tensor attend_cache(const char* op, const at::Tensor& query, const CacheHalf& k, const CacheHalf& v,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, double softcap,
                        int64_t sliding_window, const StepRows* step = nullptr) {
  TORCH_CHECK(query.dim() == 3, op, "query must be [batch, heads, head_dim], got ", query.sizes());
  TORCH_CHECK(k.same_blocks(v, 3), op, "k_cache and v_cache differ in blocks, block size or heads: ", k, " vs ", v);
  const auto dtype = k.dtype;
  TORCH_CHECK(dtype == v.dtype, op, "k_cache and v_cache must have one dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              "cache dtype must be float32, bfloat16 or float16, got ", dtype);
  const int64_t batch = query.size(0), heads = query.size(1), kv_heads = k.sizes[2];
  TORCH_CHECK(query.size(2) == k.sizes[3], op, "query head_dim ", query.size(2), " but keys have ", k.sizes[3]);
  TORCH_CHECK(heads % kv_heads == 0, op, heads, " query heads are not a multiple of ", kv_heads, " KV heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, op,
                "block_tables and seq_lens must be int32 or int64");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == batch,
              op, "block_tables must be [batch, max_blocks] and seq_lens [batch] for batch ", batch);
  TORCH_CHECK(k.strides[3] == 1 && v.strides[3] == 1, op, "each cached head's values must be contiguous");

  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const strata_kernels::FloatRows q(query);
  const Shape shape{heads, kv_heads, query.size(2), v.sizes[3], k.sizes[1], k.sizes[0], tables.size(1),
                    {k.strides[0], k.strides[1], k.strides[2]}, {v.strides[0], v.strides[1], v.strides[2]},
                    tables.stride(0), static_cast<float>(scale), static_cast<float>(softcap), sliding_window};

  const at::Tensor lens_t = seq_lens.contiguous();
  const Indices lens_at(lens_t);
  std::vector<int64_t> lens(batch);
  for (int64_t b = 0; b < batch; ++b) {
    lens[b] = lens_at[b];
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= shape.max_blocks * shape.block_size, op, "sequence ", b,
                " has length ", lens[b], " but its block table holds ", shape.max_blocks * shape.block_size,
                " tokens");
  }

  if (step && !rows_are_newest_tokens(*step, tables, lens, shape.block_size)) {
    step->store_all();
    step = nullptr;
  }

  // In query's dtype where the results can be rounded into it here, else float32 and converted.
  const bool direct = strata_kernels::FloatResults::writes(query.scalar_type());
  at::Tensor out = at::empty({batch, heads, shape.value_dim}, query.options().dtype(direct ? query.scalar_type()
                                                                                          : at::kFloat));
  const strata_kernels::FloatResults results(out);
  float* o = results.data();
  switch (dtype) {
    case at::kFloat:
      decode_attention(shape, q.data(), k.as<float>(), v.as<float>(), tables, lens, o, step);
      break;
    case at::kBFloat16:
      decode_attention(shape, q.data(), k.as<c10::BFloat16>(), v.as<c10::BFloat16>(), tables, lens, o, step);
      break;
    default:
      decode_attention(shape, q.data(), k.as<c10::Half>(), v.as<c10::Half>(), tables, lens, o, step);
      break;
  }
  results.finish();
  return direct ? out : out.to(query.scalar_type());
}

// query [B, H, D] (one token per sequence); k_cache [num_blocks, block_size, Hkv, D] and v_cache
// [num_blocks, block_size, Hkv, Dv] in float32, bfloat16 or float16; block_tables [B, max_blocks] and
// seq_lens [B] (context length including this token) int32 or int64. softcap > 0 caps the scaled scores
// with tanh; sliding_window > 0 keeps only the last sliding_window keys. Returns [B, H, Dv] in query's dtype.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, double softcap,
                                  int64_t sliding_window) {
  constexpr const char* op = "strata_cpu::paged_decode_attention: ";
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, op,
              "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  const at::Tensor k = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  const at::Tensor v = v_cache.stride(3) == 1 ? v_cache : v_cache.contiguous();
  return attend_cache(op, query, CacheHalf::of(k), CacheHalf::of(v), block_tables, seq_lens, scale, softcap,
                      sliding_window);
}

// Stores this step's key [T, Hkv, D] and value [T, Hkv, Dv] at their slots of k_cache and v_cache, converting
// to the cache's dtype: what `index_copy_` into the flattened caches does, in one call instead of two.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  constexpr const char* op = "strata_cpu::write_kv_cache: ";
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, op,
              "k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim], got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  StepRows(op, key, value, CacheHalf::of(k_cache), CacheHalf::of(v_cache), slot_mapping).store_all();
}

// A decode step's whole attention for one layer in one call: store this step's keys and values, then attend.
// kv_cache [2, num_blocks, block_size, Hkv, D] is the layer's cache as the engine allocates it, keys then values,
// so Python passes it as it is instead of splitting it into two views first.
at::Tensor decode_attention_with_kv_write(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                          const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                          double softcap, int64_t sliding_window) {
  constexpr const char* op = "strata_cpu::decode_attention_with_kv_write: ";
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, op,
              "kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], got ", kv_cache.sizes());
  const CacheHalf k = CacheHalf::of_pair(kv_cache, 0), v = CacheHalf::of_pair(kv_cache, 1);
  const StepRows step(op, key, value, k, v, slot_mapping);
  return attend_cache(op, query, k, v, block_tables, seq_lens, scale, softcap, sliding_window, &step);
}

}  // namespace

// A fragment: `small_batch_linear.cpp` owns the strata_cpu namespace, and either library may load first.
TORCH_LIBRARY_FRAGMENT(strata_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, float softcap, int sliding_window) -> Tensor");
  m.def(
      "write_kv_cache(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) "
      "-> ()");
  m.def(
      "decode_attention_with_kv_write(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, float softcap, int sliding_window) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("decode_attention_with_kv_write", &decode_attention_with_kv_write);
}
