// Strata's CPU linear for decode-sized batches: out[m, n] = sum_k x[m, k] * w[n, k] (* scale[n]) (+ bias[n]).
//
// ATen's fp32 GEMM reads a weight matrix well under the memory bandwidth when x has one to a few rows (a
// matrix-vector product), and that bandwidth bounds decoding. This kernel streams each weight byte once
// per call, in memory order and prefetched ahead where that helps, splits the weight rows across ATen's
// intra-op threads (only for layers big enough to pay for it), and widens bf16 or int8 weights 16 at a time
// in registers.
// Each dot product is summed in several independent 16-lane register tiles (so it does not wait on one
// FMA chain), and 16 rows' tiles are reduced together; up to 8 rows of x share every widened weight tile.
// A decode step so reads fp32, bf16 and int8 weights at close to the bandwidth limit.
// Wider inputs (prefill, large batches) go to oneDNN's GEMM where PyTorch has it: it runs float32 faster than
// the MKL path `at::linear` takes for these shapes.
// A float32 weight on an AVX-512 build is instead packed after loading into the column panels of Strata's own
// GEMM (`panel_gemm.h`), which replace it (`packed_stand_in`): every row count reads them, as fast as this
// kernel reads the dense weight at 1-3 rows and faster than oneDNN above, so the weight is held once.
//
// C++ with GCC/Clang vector types, compiled for this CPU (-O3 -march=native); only the widening loads
// (`float_tiles.h`) use x86 intrinsics, under #if with a plain C++ fallback for other CPUs. It is built by
// `kernels.py`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_panel_gemm.h"
#include "float_rows.h"
#include "float_tiles.h"
#include "panel_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

// Above this many rows of x ATen's GEMM is as fast or faster.
constexpr int64_t kMaxRows = 8;

using strata_kernels::kLanes;
using strata_kernels::lane_sums;
using strata_kernels::load_tile_n;
using Vec = strata_kernels::FloatTile;
using Tile = strata_kernels::RegisterTile;  // accumulations (see `RegisterTile`)
using strata_kernels::as_float_contiguous;
using strata_kernels::FloatRows;
using strata_kernels::from_registers;
using strata_kernels::load_register_tile;
using strata_kernels::to_registers;
using strata_kernels::kHasPanelGemm;

// A layer is split over threads only when each thread gets at least this much work, counted in weight
// bytes times (M + 1) / 2 (more rows of x, more arithmetic per byte): below it waking a second thread
// costs more than it saves.
constexpr int64_t kMinWorkPerThread = 128 * 1024;

// The fewest units of work (row groups here, panels in `panel_gemm`) a thread takes, each unit reading
// `unit_bytes` of weight at M rows of x. The panels use the same rule: a grain counted in FLOPs kept small
// weights on one thread at 1-2 rows, which was slower.
int64_t thread_grain(int64_t unit_bytes, int64_t M) {
  const int64_t work = std::max<int64_t>(1, unit_bytes * (M + 1) / 2);
  return std::max<int64_t>(1, (kMinWorkPerThread + work - 1) / work);
}

// Whether one native vector register holds a whole 16-float tile (AVX-512), or a tile takes several (AVX2).
constexpr bool kWideRegisters = strata_kernels::kNativeLanes == kLanes;

// Register blocking for MB rows of x and weights of type W: RB weight rows at once (each x tile then serves
// RB of them), KU tiles of each row side by side; MB * RB * KU independent FMA chains hide the FMA latency
// and, with the weight tiles, fit the 32 AVX-512 registers. Up to 4 rows of x one weight row at a time
// reads fastest (the matrix is then one sequential stream); with more, sharing each x tile between two
// weight rows saves more loads than the two interleaved streams cost. Where a tile takes several registers
// (AVX2: 16 registers of half a tile), 5 to 8 rows of x read one weight row at a time: two would hold 10-16
// tiles of sums, more than the registers (and fewer chains at 2 to 4 rows are slower there too).
// At 1-2 rows of x an iteration reads 256 bytes of the weight row, float32 or bf16 (8 bf16 tiles where
// registers allow): with 4 bf16 tiles (128 bytes) too few weight lines are in flight at once for bf16 to
// reach float32's bandwidth, and float32 with 8 tiles (512 bytes) is slower.
template <int MB, typename W>
struct Blocking {
  static constexpr int RB = MB <= 4 || !kWideRegisters ? 1 : 2;
  static constexpr int KU = MB <= 2 ? (kWideRegisters && std::is_same_v<W, c10::BFloat16> ? 8 : 4)
                            : MB <= 4 ? 2
                                      : 1;
};

// How far ahead of the loads (bytes, in the matrix's memory order) the weights are prefetched in software,
// and into which cache level (`__builtin_prefetch` locality: 3 for L1, 2 for L2); 0 bytes: not at all
// (prefetching past a matrix's end is harmless: prefetches never fault).
// Where the hardware prefetchers keep up with the stream, a software prefetch only takes the miss buffers
// the demand loads need, and one into L1 holds them longest.
// - AVX-512: 8 KiB ahead into L2 for every weight type and row count. Where the hardware prefetchers fall
//   short of the bandwidth (bf16 and float32 at one or two rows on some CPUs) it is a large gain; where they
//   keep up it costs a little at 1-2 rows, which this setting gives up. Into L2: into L1 was slower.
// - AVX2 (cache levels not compared): into L1, 512 bytes ahead for 1-2 rows of float32, where a short
//   distance does best, and 8 KiB elsewhere.
template <int MB, typename W>
constexpr int kPrefetchBytes = kWideRegisters ? 8192 : (MB <= 2 && std::is_same_v<W, float> ? 512 : 8192);
constexpr int kPrefetchLocality = kWideRegisters ? 2 : 3;

// Tiles of the dot products of RB weight rows (`K` apart) with MB rows of x (`K` apart), as lanes to be
// summed: out[m * kLanes + r]. Each widened weight tile serves all MB rows of x. The accumulators are
// `RegisterTile`s and every loop over the blocking is unrolled (`STRATA_UNROLL`), so that they stay in
// registers on CPUs whose registers are narrower than a tile.
template <int MB, int RB, int KU, typename W>
inline void row_dots(const float* x, const W* w, int64_t K, Vec* out) {
  Tile acc[MB][RB][KU] = {};
  int64_t k = 0;
  for (; k + KU * kLanes <= K; k += KU * kLanes) {
    Tile wv[RB][KU];
    STRATA_UNROLL
    for (int r = 0; r < RB; ++r) {
      if constexpr (kPrefetchBytes<MB, W> > 0) {
        STRATA_UNROLL
        for (int p = 0; p < static_cast<int>(KU * kLanes * sizeof(W)); p += 64)
          __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(w + r * K + k) +
                                                           kPrefetchBytes<MB, W> + p),
                             0, kPrefetchLocality);
      }
      STRATA_UNROLL
      for (int u = 0; u < KU; ++u) wv[r][u] = load_register_tile(w + r * K + k + u * kLanes);
    }
    STRATA_UNROLL
    for (int m = 0; m < MB; ++m) {
      STRATA_UNROLL
      for (int u = 0; u < KU; ++u) {
        const Tile xv = load_register_tile(x + m * K + k + u * kLanes);
        STRATA_UNROLL
        for (int r = 0; r < RB; ++r) acc[m][r][u] += xv * wv[r][u];
      }
    }
  }
  for (; k < K; k += kLanes) {  // the last tiles, the very last one zero-padded
    const int64_t n = std::min<int64_t>(kLanes, K - k);
    Tile wv[RB];
    STRATA_UNROLL
    for (int r = 0; r < RB; ++r) wv[r] = to_registers(load_tile_n(w + r * K + k, n));
    STRATA_UNROLL
    for (int m = 0; m < MB; ++m) {
      const Tile xv = to_registers(load_tile_n(x + m * K + k, n));
      STRATA_UNROLL
      for (int r = 0; r < RB; ++r) acc[m][r][0] += xv * wv[r];
    }
  }
  STRATA_UNROLL
  for (int m = 0; m < MB; ++m) {
    STRATA_UNROLL
    for (int r = 0; r < RB; ++r) {
      Tile t = acc[m][r][0];
      STRATA_UNROLL
      for (int u = 1; u < KU; ++u) t += acc[m][r][u];
      out[m * kLanes + r] = from_registers(t);
    }
  }
}

template <typename O>
inline void store_out(O* out, float v) {
  *out = static_cast<O>(v);
}

// Weight rows [g * kLanes, ...) in groups of kLanes: the rows' lane tiles are collected, summed together
// (`lane_sums`) and scaled, biased and stored as kLanes outputs per row of x (rows of `out` `ldo` apart).
template <int MB, typename W, typename B, typename O>
void small_batch_rows(const float* x, const W* w, const float* scale, const B* bias, O* out, int64_t ldo,
                      int64_t N, int64_t K, int64_t g_begin, int64_t g_end) {
  Vec tiles[MB][kLanes];
  for (int64_t g = g_begin; g < g_end; ++g) {
    const int64_t n0 = g * kLanes;
    const int64_t rows = std::min<int64_t>(kLanes, N - n0);
    constexpr int RB = Blocking<MB, W>::RB, KU = Blocking<MB, W>::KU;
    int64_t i = 0;
    for (; i + RB <= rows; i += RB) row_dots<MB, RB, KU>(x, w + (n0 + i) * K, K, &tiles[0][i]);
    for (; i < rows; ++i) row_dots<MB, 1, KU>(x, w + (n0 + i) * K, K, &tiles[0][i]);
    for (int m = 0; m < MB; ++m) {
      for (int64_t j = rows; j < kLanes; ++j) tiles[m][j] = Vec{};
      const Vec sums = lane_sums<kLanes>(tiles[m]);
      for (int64_t j = 0; j < rows; ++j) {
        float v = sums[j];
        if (scale) v *= scale[n0 + j];
        if (bias) v += static_cast<float>(bias[n0 + j]);
        store_out(out + m * ldo + n0 + j, v);
      }
    }
  }
}

// `small_batch_rows` for the M (1 to kMaxRows) rows of x known only at run time.
template <typename W, typename B, typename O>
void small_batch_rows_m(const float* x, const W* w, const float* scale, const B* bias, O* out, int64_t ldo,
                        int64_t M, int64_t N, int64_t K, int64_t g_begin, int64_t g_end) {
  switch (M) {
    case 1: small_batch_rows<1>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    case 2: small_batch_rows<2>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    case 3: small_batch_rows<3>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    case 4: small_batch_rows<4>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    case 5: small_batch_rows<5>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    case 6: small_batch_rows<6>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    case 7: small_batch_rows<7>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
    default: small_batch_rows<8>(x, w, scale, bias, out, ldo, N, K, g_begin, g_end); break;
  }
}

// Runs run(begin, end) over [0, groups) row groups of `element_size`-byte weights with K columns: on this
// thread when there is one thread's worth of work (no parallel region at all), else split over ATen's threads.
template <typename F>
void for_row_groups(int64_t groups, int64_t K, int64_t element_size, int64_t M, const F& run) {
  const int64_t grain = thread_grain(kLanes * K * element_size, M);
  if (groups <= grain) {
    run(0, groups);
  } else {
    at::parallel_for(0, groups, grain, run);
  }
}

template <typename W, typename B, typename O>
void small_batch_kernel(const float* x, const W* w, const float* scale, const B* bias, O* out, int64_t M,
                        int64_t N, int64_t K) {
  for_row_groups((N + kLanes - 1) / kLanes, K, sizeof(W), M, [&](int64_t begin, int64_t end) {
    small_batch_rows_m(x, w, scale, bias, out, N, M, N, K, begin, end);
  });
}

template <typename W, typename O>
void dispatch_bias(const float* x, const W* w, const float* scale, const at::Tensor* bias, O* out, int64_t M,
                   int64_t N, int64_t K) {
  if (bias == nullptr) {
    small_batch_kernel(x, w, scale, static_cast<const float*>(nullptr), out, M, N, K);
  } else if (bias->scalar_type() == at::kBFloat16) {
    small_batch_kernel(x, w, scale, bias->data_ptr<c10::BFloat16>(), out, M, N, K);
  } else {
    small_batch_kernel(x, w, scale, bias->data_ptr<float>(), out, M, N, K);
  }
}

template <typename O>
void dispatch_weight(const float* x, const at::Tensor& w, const float* scale, const at::Tensor* bias, O* out,
                     int64_t M, int64_t N, int64_t K) {
  switch (w.scalar_type()) {
    case at::kFloat: dispatch_bias(x, w.data_ptr<float>(), scale, bias, out, M, N, K); break;
    case at::kBFloat16: dispatch_bias(x, w.data_ptr<c10::BFloat16>(), scale, bias, out, M, N, K); break;
    default: dispatch_bias(x, w.data_ptr<int8_t>(), scale, bias, out, M, N, K); break;
  }
}

bool has_onednn_linear() {
  static const bool available =
      at::hasMKLDNN() && c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""}).has_value();
  return available;
}

// Whether oneDNN has its bfloat16 path on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; bfloat16
// arithmetic in hardware with AVX512-BF16 or AMX), asked once. Elsewhere (AVX2) its bfloat16 linear
// raises errors.
bool has_onednn_bfloat16() {
  static const bool available = [] {
    const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_bf16_supported", ""});
    return has_onednn_linear() && op.has_value() && op->typed<bool()>().call();
  }();
  return available;
}

// oneDNN's linear, the op Inductor's CPU fusions call, on a dense [N, K] weight.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               std::string_view, c10::List<std::optional<at::Scalar>>,
                               std::optional<std::string_view>);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<Signature>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// Prepacked weights, found by the data pointer of the weight they were packed from, or of the stand-in that
// replaced it (`packed_stand_in`). An entry holds only weak references: the packed tensor belongs to whoever
// registered it (the layer) and is freed with it, and an entry whose weight storage is gone, or whose weight
// was resized or written in place since, no longer matches.
struct PackedWeight {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
  int64_t version;
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> packed;
  bool gate_up_pairs;  // panels of a GLU MLP's [gate; up] weight in pairs (`pack_panels` with glu)

  bool matches(const at::Tensor& weight) const {
    return !storage.expired() && storage._unsafe_get_target() == weight.storage().unsafeGetStorageImpl() &&
           weight.sizes().equals(sizes) && weight.strides().equals(strides) &&  // no vector copies per call
           weight.scalar_type() == dtype && weight._version() == version;
  }
};

std::mutex packed_mutex;
std::unordered_map<const void*, PackedWeight> packed_weights;

// A weight's registered packed form; `tensor` undefined where it has none.
struct Packed {
  at::Tensor tensor;
  bool gate_up_pairs = false;

  bool defined() const { return tensor.defined(); }
  // The plain (not paired) packed tensor, or an undefined one.
  at::Tensor plain() const { return gate_up_pairs ? at::Tensor() : tensor; }
};

Packed find_packed(const at::Tensor& weight) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  const auto it = packed_weights.find(weight.data_ptr());
  if (it == packed_weights.end()) return {};
  if (!it->second.matches(weight)) {
    packed_weights.erase(it);
    return {};
  }
  auto packed = it->second.packed.lock();
  return packed ? Packed{at::Tensor(std::move(packed)), it->second.gate_up_pairs} : Packed{};
}

// Registers `packed` as the packed form of `weight` (replacing any other), holding only weak references.
void register_packed(const at::Tensor& weight, const at::Tensor& packed, bool gate_up_pairs) {
  std::lock_guard<std::mutex> lock(packed_mutex);
  std::erase_if(packed_weights, [](const auto& entry) { return entry.second.packed.expired(); });
  packed_weights.insert_or_assign(
      weight.data_ptr(),
      PackedWeight{c10::weak_intrusive_ptr<c10::StorageImpl>(weight.storage().getWeakStorageImpl()),
                   weight.sizes().vec(), weight.strides().vec(), weight.scalar_type(), weight._version(),
                   c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(packed.getIntrusivePtr()),
                   gate_up_pairs});
}

// Whether `weight` is a stand-in (`packed_stand_in`): every stride 0, which no weight a model loads has.
bool is_stand_in(const at::Tensor& weight) {
  return weight.dim() == 2 && weight.stride(0) == 0 && weight.stride(1) == 0;
}

// A stand-in's packed form, which every path must read: its dense values are gone.
Packed stand_in_packed(const at::Tensor& weight) {
  Packed packed = find_packed(weight);
  TORCH_CHECK(packed.defined(), "strata_cpu: the packed form that replaced this ", weight.sizes(),
              " weight is gone (its layer was freed, or the stand-in was written to)");
  return packed;
}

// Whether float32 weights are packed, into Strata's column panels (`panel_gemm.h`): the one packed form, read
// for every row count. Only where the panel GEMM is built (AVX-512); other weights and builds keep the dense
// weight, which wide inputs hand to oneDNN as it is (docs/cpu-kernels.md, "Packed weights").
constexpr bool kFloatPanels = kHasPanelGemm;

// Whether float32 weights packed now take the bf16x3 form of `amx_panel_gemm.h`: where this build has the
// AMX kernel, the process may use the tiles, and PyTorch's float32 matmul precision is "high" or "medium"
// (`torch.set_float32_matmul_precision`) when the weight is packed. Its packed tensor is bfloat16, the
// float32 panels' float32: that is how the calls tell them apart.
bool packs_bf16x3() {
#ifdef STRATA_AMX
  return at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST &&
         strata_kernels::amx_usable();
#else
  return false;
#endif
}

// A float32 weight's panels as they are to be packed now: bf16x3 items or float32 panels.
at::Tensor pack_float_panels(const at::Tensor& weight, bool glu) {
  return packs_bf16x3() ? strata_kernels::pack_amx_panels(weight, glu) : strata_kernels::pack_panels(weight, glu);
}

// Whether registered panels are in the form packing would give now (a change of precision repacks).
bool packed_as_now(const at::Tensor& packed) {
  return (packed.scalar_type() == at::kBFloat16) == packs_bf16x3();
}

// float32 `weight` [N, K] packed into column panels (bf16x3 items at "high" precision on AMX, `packs_bf16x3`)
// and registered, so that `linear` with this very weight (same storage, shape and version) reads the panels
// for every row count, as it does for the stand-in that then replaces the weight (`packed_stand_in`). The
// caller keeps the returned tensor alive for as long as the weight should use it. A weight registered
// already and unchanged since gets the same panels back, not a second copy. Returns nothing where the panels
// are not built (`kFloatPanels`), or the weight is not a contiguous, non-empty float32 matrix: `linear` then
// reads the weight.
std::optional<at::Tensor> prepack_linear_weight(const at::Tensor& weight) {
  if (!kFloatPanels || weight.dim() != 2 || !weight.is_contiguous() || weight.numel() == 0 ||
      weight.scalar_type() != at::kFloat) {
    return std::nullopt;
  }
  if (const Packed existing = find_packed(weight);
      existing.defined() && !existing.gate_up_pairs && packed_as_now(existing.tensor)) {
    return existing.tensor;
  }
  at::Tensor packed = pack_float_panels(weight, false);
  register_packed(weight, packed, false);
  return packed;
}

using strata_kernels::GateActivation;

GateActivation gate_activation_named(std::string_view name) {
  if (name == "silu") return GateActivation::kSilu;
  if (name == "gelu_tanh") return GateActivation::kGeluTanh;
  TORCH_CHECK(false, "strata_cpu: unknown GLU activation '", name, "' (silu or gelu_tanh)");
}

// A GLU MLP's [gate; up] weight [2I, K] packed for `linear_glu`: float32 panels in gate and up pairs, so that
// the GEMM's sums become act(gate) * up before they leave the registers. Without it the MLP writes the
// [M, 2I] product to memory and reads it back for the activation, which at prefill sizes slows the GEMM that
// writes it below its siblings. Returns nothing where the panels do not serve it (no AVX-512, not a contiguous
// float32 matrix with an even number of rows, or K beyond one pass of the panels); `linear_glu` then multiplies
// and activates separately.
std::optional<at::Tensor> prepack_glu_weight(const at::Tensor& weight, std::string_view activation) {
  gate_activation_named(activation);
  if (!kFloatPanels || weight.dim() != 2 || !weight.is_contiguous() || weight.scalar_type() != at::kFloat ||
      weight.size(0) == 0 || weight.size(0) % 2 != 0 || weight.size(1) == 0 ||
      (weight.size(1) > strata_kernels::kMaxDepth && !packs_bf16x3())) {
    return std::nullopt;
  }
  if (const Packed existing = find_packed(weight);
      existing.defined() && existing.gate_up_pairs && packed_as_now(existing.tensor)) {
    return existing.tensor;
  }
  at::Tensor packed = pack_float_panels(weight, true);
  register_packed(weight, packed, true);
  return packed;
}

// x [M, K] (float32 or bfloat16, M and K at least 1) times float32 weights packed in panels (`weights[i]`
// packed as `packed[i]`, its bias `biases[i]` or none), their outputs side by side: [M, sum of N] in x's
// dtype. With a GATE, each weight is a GLU MLP's [gate; up] packed in pairs (`prepack_glu_weight`, no bias)
// and gives its N / 2 values act(gate) * up.
template <GateActivation GATE = GateActivation::kNone>
at::Tensor panel_linear(const at::Tensor& x, at::TensorList weights, const std::vector<at::Tensor>& packed,
                        const std::vector<std::optional<at::Tensor>>& biases) {
  const at::Tensor xc = as_float_contiguous(x);
  std::vector<at::Tensor> held;  // float32 contiguous biases, alive for the call
  std::vector<const float*> bias_of;
  for (const auto& b : biases) {
    bias_of.push_back(b ? held.emplace_back(as_float_contiguous(*b)).data_ptr<float>() : nullptr);
  }
  const int64_t M = x.size(0), K = x.size(1);
  const bool bf16x3 = packed[0].scalar_type() == at::kBFloat16;
  std::vector<strata_kernels::PanelWeight> parts;
  std::vector<strata_kernels::AmxPanelWeight> amx_parts;
  int64_t columns = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t N = weights[i].size(0);
    if (bf16x3) {
      amx_parts.push_back({reinterpret_cast<const uint16_t*>(packed[i].data_ptr()), bias_of[i], N, columns});
    } else {
      parts.push_back({packed[i].data_ptr<float>(), bias_of[i], N, columns});
    }
    columns += GATE == GateActivation::kNone ? N : N / 2;
  }
  at::Tensor out = at::empty({M, columns}, x.options().dtype(at::kFloat));
  if (bf16x3) {
    strata_kernels::amx_panel_gemm<GATE>(xc.data_ptr<float>(), M, K, amx_parts, out.data_ptr<float>(), columns,
                                         thread_grain(strata_kernels::amx_item_bytes(K), M));
  } else {
    strata_kernels::panel_gemm<GATE>(xc.data_ptr<float>(), M, K, parts, out.data_ptr<float>(), columns,
                                     thread_grain(strata_kernels::kPanelColumns * K * sizeof(float), M));
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Whether `packed` is a float32 weight's panels or bf16x3 items, which every row count reads.
bool is_float_panels(const at::Tensor& weight, const Packed& packed) {
  return kFloatPanels && packed.defined() && weight.scalar_type() == at::kFloat;
}

// The dense [N, K] float32 values of a weight from its panels or bf16x3 items (those within about 2^-16 of
// them): for the rare reader of a stand-in's values (`unpack_weight`, `linear` on a GLU's paired panels).
at::Tensor unpack_float_panels(const at::Tensor& weight, const Packed& packed) {
  const int64_t N = weight.size(0), K = weight.size(1);
  return packed.tensor.scalar_type() == at::kBFloat16
             ? strata_kernels::unpack_amx_panels(packed.tensor, N, K, packed.gate_up_pairs)
             : strata_kernels::unpack_panels(packed.tensor, N, K, packed.gate_up_pairs);
}

// `x @ weight.T + bias` for wide x: oneDNN's linear when PyTorch was built with it, else ATen's. `w` is
// `weight` in x's dtype.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  if (!has_onednn_linear() || x.scalar_type() == at::kHalf ||
      (x.scalar_type() == at::kBFloat16 && !has_onednn_bfloat16())) {
    return at::linear(x, w, bias);  // no oneDNN bfloat16 path here (`has_onednn_bfloat16`)
  }
  return onednn_linear(x, w, bias);
}

// `x @ (qweight * scale[:, None]).T + bias` for wide x. Where oneDNN has its bfloat16 path, x and the
// int8 weights (widened for the call) go in as bfloat16 (int8 values are exact in bfloat16) and the scales
// multiply the product: much faster than widening the weights to float32, at the cost of bfloat16's
// rounding of the activations. Elsewhere, float32.
at::Tensor wide_int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias) {
  const at::Tensor scale_f = as_float_contiguous(scale);
  at::Tensor out;
  if (has_onednn_bfloat16()) {
    out = onednn_linear(x.to(at::kBFloat16).contiguous(), qweight.to(at::kBFloat16), std::nullopt)
              .to(at::kFloat)
              .mul_(scale_f);
  } else {
    out = at::linear(as_float_contiguous(x), at::mul(qweight.to(at::kFloat), scale_f.unsqueeze(1)));
  }
  if (bias) out.add_(*bias);
  return out.to(x.scalar_type());
}

// x [M, K] float32 or bfloat16; weight [N, K] float32, bfloat16 or int8 (then `scale` [N] float32 is
// required), or the stand-in of a float32 weight's panels; bias [N]. Returns [M, N] in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "strata_cpu::linear: x and weight must be 2-D");
  TORCH_CHECK(x.size(1) == weight.size(1), "strata_cpu::linear: x has ", x.size(1),
              " features but weight expects ", weight.size(1));
  const auto wtype = weight.scalar_type();
  TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kChar,
              "strata_cpu::linear: weight dtype must be float32, bfloat16 or int8, got ", wtype);
  TORCH_CHECK((wtype == at::kChar) == scale.has_value(), "strata_cpu::linear: int8 weights need a scale");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  for (const auto& [name, t] : {std::pair{"scale", &scale}, std::pair{"bias", &bias}}) {
    TORCH_CHECK(!t->has_value() || ((*t)->dim() == 1 && (*t)->size(0) == N), "strata_cpu::linear: ", name,
                " must have one value per output (", N, ")");
  }
  if (K == 0) {  // no input features: every sum is empty
    const at::Tensor out = at::zeros({M, N}, x.options());
    return bias ? out.add_(*bias) : out;
  }
  if (M == 0 || N == 0) return at::empty({M, N}, x.options());
  if (const Packed packed = is_stand_in(weight) ? stand_in_packed(weight) : find_packed(weight);
      is_float_panels(weight, packed)) {
    if (packed.gate_up_pairs) return linear(x, unpack_float_panels(weight, packed), scale, bias);
    return panel_linear(x, {weight}, {packed.tensor}, {bias});
  }
  if (M > kMaxRows && wtype == at::kChar) return wide_int8_linear(x, weight, *scale, bias);
  if (M > kMaxRows) {
    return wide_linear(x.contiguous(), weight.to(x.scalar_type()).contiguous(),
                       bias ? std::optional<at::Tensor>(bias->to(x.scalar_type())) : std::nullopt);
  }
  // Small tensors are used as they come when they already have the layout the kernel reads; only what
  // does not is converted (a bf16 x to float32, a strided weight to contiguous).
  const FloatRows xf(x);
  const at::Tensor wc = weight.is_contiguous() ? weight : weight.contiguous();
  const at::Tensor scale_f = scale ? as_float_contiguous(*scale) : at::Tensor();
  at::Tensor bias_c;
  if (bias) {
    bias_c = (bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16) && bias->is_contiguous()
                 ? *bias
                 : as_float_contiguous(*bias);
  }
  const float* s = scale ? scale_f.data_ptr<float>() : nullptr;
  const at::Tensor* b = bias ? &bias_c : nullptr;
  const float* xp = xf.data();
  const auto xtype = x.scalar_type();
  if (xtype == at::kBFloat16) {
    at::Tensor out = at::empty({M, N}, x.options());
    dispatch_weight(xp, wc, s, b, out.data_ptr<c10::BFloat16>(), M, N, K);
    return out;
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  dispatch_weight(xp, wc, s, b, out.data_ptr<float>(), M, N, K);
  return xtype == at::kFloat ? out : out.to(xtype);
}

// act(x @ gate.T) * (x @ up.T) for a GLU MLP's weight [gate; up] ([2I, K]): [M, I] in x's dtype. One panel
// GEMM whose sums are activated in registers where the weight was packed for it (`prepack_glu_weight`);
// otherwise `linear` and the activation as ATen computes it.
at::Tensor linear_glu(const at::Tensor& x, const at::Tensor& weight, std::string_view activation) {
  const GateActivation gate = gate_activation_named(activation);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(0) % 2 == 0,
              "strata_cpu::linear_glu: x must be [M, K] and weight [2I, K], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.size(1) == weight.size(1), "strata_cpu::linear_glu: x has ", x.size(1),
              " features but weight expects ", weight.size(1));
  const int64_t M = x.size(0), N = weight.size(0);
  if (M > 0 && N > 0 && x.size(1) > 0) {
    if (const Packed packed = is_stand_in(weight) ? stand_in_packed(weight) : find_packed(weight);
        is_float_panels(weight, packed) && packed.gate_up_pairs) {
      return gate == GateActivation::kSilu
                 ? panel_linear<GateActivation::kSilu>(x, {weight}, {packed.tensor}, {std::nullopt})
                 : panel_linear<GateActivation::kGeluTanh>(x, {weight}, {packed.tensor}, {std::nullopt});
    }
  }
  const at::Tensor both = linear(x, weight, std::nullopt, std::nullopt);
  const at::Tensor g = both.narrow(1, 0, N / 2), up = both.narrow(1, N / 2, N / 2);
  return (gate == GateActivation::kSilu ? at::silu(g) : at::gelu(g, "tanh")).mul_(up);
}

// Each weight's outputs go to its own columns of out [M, sum of N], which starts at its first column.
template <typename W, typename O>
void group_kernel(const float* x, at::TensorList weights, O* out, int64_t M, int64_t K) {
  std::vector<int64_t> first_group{0};  // weight i owns row groups [first_group[i], first_group[i + 1])
  std::vector<int64_t> first_column{0};
  for (const auto& w : weights) {
    first_group.push_back(first_group.back() + (w.size(0) + kLanes - 1) / kLanes);
    first_column.push_back(first_column.back() + w.size(0));
  }
  const int64_t ldo = first_column.back();
  for_row_groups(first_group.back(), K, sizeof(W), M, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t lo = std::max(begin, first_group[i]), hi = std::min(end, first_group[i + 1]);
      if (lo >= hi) continue;
      small_batch_rows_m(x, weights[i].data_ptr<W>(), nullptr, static_cast<const float*>(nullptr),
                         out + first_column[i], ldo, M, weights[i].size(0), K, lo - first_group[i],
                         hi - first_group[i]);
    }
  });
}

// x @ weight.T for each of several weights that read the same x (a layer's q, k and v projections), side by
// side in one [M, sum of N] tensor: one call and one parallel region over all their rows, where separate
// `linear` calls each pay a dispatch, a fork and a join. One tensor, not a list, so that Inductor's C++
// wrapper calls it through the dispatcher (a list return goes through Python, which cost more than the
// grouping saved). One panel GEMM call when every weight was packed into panels (of one form); up to
// kMaxRows rows of x, one small-batch call over dense weights of one dtype, float32 or bfloat16, contiguous.
// Anything else is `linear` per weight, concatenated.
at::Tensor linear_group(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(!weights.empty(), "strata_cpu::linear_group: needs at least one weight");
  const bool shaped = x.dim() == 2 && x.size(0) >= 1 && x.size(1) >= 1;
  if (shaped) {
    std::vector<at::Tensor> panels;
    for (const auto& w : weights) {
      const Packed p = w.dim() == 2 && w.size(1) == x.size(1) ? find_packed(w) : Packed{};
      if (!is_float_panels(w, p) || p.gate_up_pairs ||
          (!panels.empty() && p.tensor.scalar_type() != panels[0].scalar_type())) {
        break;
      }
      panels.push_back(p.tensor);
    }
    if (panels.size() == weights.size()) {
      return panel_linear(x, weights, panels, std::vector<std::optional<at::Tensor>>(weights.size()));
    }
  }
  bool grouped = shaped && x.size(0) <= kMaxRows &&
                 (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
  for (const auto& w : weights) {
    grouped = grouped && w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous() &&
              w.scalar_type() == weights[0].scalar_type() &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16);
  }
  if (!grouped) {
    std::vector<at::Tensor> outs;
    for (const auto& w : weights) outs.push_back(linear(x, w, std::nullopt, std::nullopt));
    return at::cat(outs, 1);
  }
  const FloatRows xf(x);
  const int64_t M = x.size(0), K = x.size(1);
  int64_t columns = 0;
  for (const auto& w : weights) columns += w.size(0);
  at::Tensor out = at::empty({M, columns}, x.options());  // written in x's dtype, float32 or bfloat16
  const auto run = [&](auto* o) {
    if (weights[0].scalar_type() == at::kFloat) group_kernel<float>(xf.data(), weights, o, M, K);
    else group_kernel<c10::BFloat16>(xf.data(), weights, o, M, K);
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<c10::BFloat16>());
  return out;
}

// A stand-in for float32 `weight` once its registered panels (or bf16x3 items) replace it: the same sizes and
// dtype over a single NaN element (no memory; a dense read of it gives NaN, never plausible numbers),
// registered with those panels, so that every op given the stand-in reads them. The caller then drops the
// dense weight.
at::Tensor packed_stand_in(const at::Tensor& weight) {
  const Packed packed = find_packed(weight);
  TORCH_CHECK(weight.dim() == 2 && is_float_panels(weight, packed),
              "strata_cpu::packed_stand_in: the weight has no registered float32 panels");
  if (is_stand_in(weight)) return weight;
  const at::Tensor stand_in = at::full({1}, std::numeric_limits<float>::quiet_NaN(), weight.options())
                                  .as_strided(weight.sizes(), {0, 0});
  register_packed(stand_in, packed.tensor, packed.gate_up_pairs);
  return stand_in;
}

// The dense values of a stand-in's weight, unpacked from the panels that replaced it.
at::Tensor unpack_weight(const at::Tensor& stand_in) {
  TORCH_CHECK(is_stand_in(stand_in), "strata_cpu::unpack_weight: not a stand-in (`packed_stand_in`)");
  return unpack_float_panels(stand_in, stand_in_packed(stand_in));
}

}  // namespace

TORCH_LIBRARY(strata_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("linear_group(Tensor x, Tensor[] weights) -> Tensor");
  m.def("prepack_linear_weight(Tensor weight) -> Tensor?");
  m.def("linear_glu(Tensor x, Tensor weight, str activation) -> Tensor");
  m.def("prepack_glu_weight(Tensor weight, str activation) -> Tensor?");
  m.def("packed_stand_in(Tensor weight) -> Tensor");
  m.def("unpack_weight(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_group", &linear_group);
  m.impl("prepack_linear_weight", &prepack_linear_weight);
  m.impl("linear_glu", &linear_glu);
  m.impl("prepack_glu_weight", &prepack_glu_weight);
  m.impl("packed_stand_in", &packed_stand_in);
  m.impl("unpack_weight", &unpack_weight);
}
