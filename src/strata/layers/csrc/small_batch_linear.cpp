// Strata's CPU linear for decode-sized batches: out[m, n] = sum_k x[m, k] * w[n, k] (* scale[n]) (+ bias[n]).
//
// ATen's fp32 GEMM reads a weight matrix at 10-15 GB/s when x has one to a few rows (a matrix-vector
// product), well under the memory bandwidth that bounds decoding. This kernel streams each weight row
// once per four rows of x, splits the weight rows across ATen's intra-op threads, and widens bf16 or int8
// weights in registers, so a decode step reads each weight byte once at close to the bandwidth limit.
// Wider inputs (prefill, large batches) go to oneDNN's GEMM where PyTorch has it: on the CPUs measured it
// runs float32 at about twice the rate of the MKL path `at::linear` takes for these shapes.
//
// Plain C++ vectorised by the compiler (-O3 -march=native); it is built on first use (`cpu_kernels.py`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>

namespace {

// Above this many rows of x ATen's GEMM is as fast or faster (measured on AVX-512 and AVX2 machines).
constexpr int64_t kMaxRows = 8;
constexpr int kRowBlock = 4;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

// Dot products of one weight row with MB rows of x; each widened weight element serves all MB rows.
template <int MB, typename W>
inline void row_dots(const float* x, int64_t K, const W* row, float* acc) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  const float* x1 = x + (MB > 1 ? K : 0);
  const float* x2 = x + (MB > 2 ? 2 * K : 0);
  const float* x3 = x + (MB > 3 ? 3 * K : 0);
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t k = 0; k < K; ++k) {
    const float w = widen(row[k]);
    a0 += x[k] * w;
    if constexpr (MB > 1) a1 += x1[k] * w;
    if constexpr (MB > 2) a2 += x2[k] * w;
    if constexpr (MB > 3) a3 += x3[k] * w;
  }
  acc[0] = a0;
  if constexpr (MB > 1) acc[1] = a1;
  if constexpr (MB > 2) acc[2] = a2;
  if constexpr (MB > 3) acc[3] = a3;
}

template <typename W>
void small_batch_kernel(const float* x, const W* w, const float* scale, const float* bias, float* out,
                        int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const W* row = w + n * K;
      const float s = scale ? scale[n] : 1.f;
      const float b = bias ? bias[n] : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
        float acc[kRowBlock];
        const int64_t rows = std::min<int64_t>(kRowBlock, M - m0);
        const float* xm = x + m0 * K;
        switch (rows) {
          case 1: row_dots<1>(xm, K, row, acc); break;
          case 2: row_dots<2>(xm, K, row, acc); break;
          case 3: row_dots<3>(xm, K, row, acc); break;
          default: row_dots<4>(xm, K, row, acc); break;
        }
        for (int64_t i = 0; i < rows; ++i) out[(m0 + i) * N + n] = acc[i] * s + b;
      }
    }
  });
}

// `x @ w.T + bias` for wide x: oneDNN's linear (the op Inductor's CPU fusions call) when PyTorch was built
// with it, else ATen's.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                  std::string_view, c10::List<std::optional<at::Scalar>>,
                                  std::optional<std::string_view>);
  static const auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (handle && at::hasMKLDNN() && x.scalar_type() != at::kHalf) {
    static const auto op = handle->typed<OneDnnLinear>();
    return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  }
  return at::linear(x, w, bias);
}

// x [M, K] float32 or bfloat16; weight [N, K] float32, bfloat16 or int8 (then `scale` [N] float32 is
// required); bias [N]. Returns [M, N] in x's dtype.
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
  const at::Tensor scale_f = scale ? scale->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  if (M > kMaxRows) {
    const at::Tensor w =
        wtype == at::kChar ? at::mul(weight.to(at::kFloat), scale_f.unsqueeze(1)).to(x.scalar_type())
                           : weight.to(x.scalar_type());
    return wide_linear(x.contiguous(), w.contiguous(),
                       bias ? std::optional<at::Tensor>(bias->to(x.scalar_type())) : std::nullopt);
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor wc = weight.contiguous();
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* s = scale ? scale_f.data_ptr<float>() : nullptr;
  const float* b = bias ? bias_f.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  switch (wtype) {
    case at::kFloat: small_batch_kernel(xf.data_ptr<float>(), wc.data_ptr<float>(), s, b, o, M, N, K); break;
    case at::kBFloat16:
      small_batch_kernel(xf.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), s, b, o, M, N, K);
      break;
    default: small_batch_kernel(xf.data_ptr<float>(), wc.data_ptr<int8_t>(), s, b, o, M, N, K); break;
  }
  return out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(strata_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_cpu, CPU, m) { m.impl("linear", &linear); }
