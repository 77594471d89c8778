// The row-wise ops of a decoder layer on AVX2 CPUs: RMSNorm (also fused with the residual add before it),
// SwiGLU's silu(gate) * up over the fused gate|up projection, and RoPE on the q|k heads of a prefill chunk.
//
// Why: at decode sizes (a few rows of 576 or 1536 floats) torch's versions cost 5-35 us each in dispatch and
// intra-op threading for well under 1 us of arithmetic, and a decode step runs ~150 of them. Each op here is
// one call; small inputs stay on the calling thread, prefill-sized ones are split over rows. Every row is
// computed alone in a fixed order, so a row's result does not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <tuple>

#include "row_ops.h"

namespace {

using morphserve_cpu::add_row;
using morphserve_cpu::rms_norm_row;
using morphserve_cpu::silu_mul_row;

// Elements below which handing rows to a second thread costs more than it saves (a wake-up is ~10-50 us).
constexpr int64_t kSerialElements = 1 << 16;

void check_rows(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2,
              op, ": ", what, " must be a 2-D fp32 CPU tensor [rows, features], got ", t.scalar_type(), " with ",
              t.dim(), " dims");
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(1),
              op, ": weight must be a contiguous fp32 vector of ", x.size(1), " features");
}

template <typename F>
void for_rows(int64_t rows, int64_t cols, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_rows(input, "rms_norm", "input");
  check_norm_weight(input, weight, "rms_norm");
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), N = x.size(1);
  at::Tensor out = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(M, N, [&](int64_t r) { rms_norm_row(xp + r * N, wp, op + r * N, N, static_cast<float>(eps)); });
  return out;
}

// (h + delta, rms_norm(h + delta)): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(h, "add_rms_norm", "h");
  check_rows(delta, "add_rms_norm", "delta");
  TORCH_CHECK(h.sizes() == delta.sizes(), "add_rms_norm: h ", h.sizes(), " and delta ", delta.sizes(), " differ in shape");
  check_norm_weight(h, weight, "add_rms_norm");
  const at::Tensor a = h.contiguous(), b = delta.contiguous();
  const int64_t M = a.size(0), N = a.size(1);
  at::Tensor sum = at::empty({M, N}, a.options()), out = at::empty({M, N}, a.options());
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  for_rows(M, N, [&](int64_t r) {
    add_row(ap + r * N, bp + r * N, sp + r * N, N);
    rms_norm_row(sp + r * N, wp, op + r * N, N, static_cast<float>(eps));
  });
  return {sum, out};
}

// gate_up [M, 2I] (gate | up) -> silu(gate) * up [M, I], silu(g) = g / (1 + e^-g).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up has an odd number of features (", gate_up.size(1),
              "); expected gate | up of equal width");
  const at::Tensor gu = gate_up.contiguous();
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(M, I, [&](int64_t r) { silu_mul_row(gp + r * 2 * I, op + r * I, I); });
  return out;
}

// Half-split RoPE of one head: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s], each product and sum rounded on its own
// (no FMA contraction: the same fp32 ops as torch's apply_rope, so the prefill path keeps its bits).
__attribute__((optimize("fp-contract=off"))) void rope_head(const float* x, const float* c, const float* s, float* out,
                                                              int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(x2, cv), _mm256_mul_ps(x1, sv)));
  }
  for (; i < half; ++i) {
    const float a = x[i] * c[i], b = x[half + i] * s[i], d = x[half + i] * c[i], e = x[i] * s[i];
    out[i] = a - b;
    out[half + i] = d + e;
  }
}

// qkv [T, >= heads * D] (the fused projection: its first `heads` heads are q then k), cos/sin [T, D/2] ->
// those heads RoPE'd, [T, heads, D]. One pass where torch's version makes seven (4 multiplies, a subtract, an
// add and a cat over the chunk): at a 512-token prefill chunk those took ~11% of the prefill.
at::Tensor rope_heads(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  check_rows(qkv, "rope_heads", "qkv");
  check_rows(cos, "rope_heads", "cos");
  check_rows(sin, "rope_heads", "sin");
  const int64_t T = qkv.size(0), half = cos.size(1), D = 2 * half;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T, "rope_heads: cos ", cos.sizes(), " and sin ", sin.sizes(),
              " must both be [", T, ", D/2]");
  TORCH_CHECK(heads > 0 && heads * D <= qkv.size(1), "rope_heads: ", heads, " heads of ", D, " do not fit a row of ",
              qkv.size(1));
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = sn.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = x.size(1);
  for_rows(T, heads * D, [&](int64_t r) {
    for (int64_t h = 0; h < heads; ++h) rope_head(xp + r * ld + h * D, cp + r * half, sp + r * half, op + (r * heads + h) * D, half);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_heads(Tensor qkv, Tensor cos, Tensor sin, int heads) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("rope_heads", rope_heads);
}
