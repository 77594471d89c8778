// Paged attention for decode rows on the CPU: one new query token per sequence against its cached keys and
// values, read in place from the pool's segments (no gather copy, no padding, no mask).
//
// Why: in torch a decode step's attention per layer is ~6 ops (gather K, gather V, select q, masked SDPA over
// the padded batch, scatter the output); at SmolLM2's sizes each costs more in dispatch than in arithmetic.
// Here one task per (sequence, KV head) walks that sequence's slots once for scores and once for values.
// Every sequence is computed alone, in the same order, so its result does not depend on the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

at::Tensor paged_decode_attention(const at::Tensor& q, at::TensorList segments, const at::Tensor& segment_of,
                                  const at::Tensor& slot_of, const at::Tensor& lens, int64_t layer, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_decode_attention: fp32 q [B, H, D] expected");
  TORCH_CHECK(!segments.empty(), "paged_decode_attention: no KV segments");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const auto& s0 = segments[0];
  TORCH_CHECK(s0.dim() == 5 && s0.size(4) == D, "paged_decode_attention: segments [layers, 2, slots, KVH, D] expected");
  const int64_t KVH = s0.size(3), G = H / KVH;
  TORCH_CHECK(H % KVH == 0, "paged_decode_attention: ", H, " query heads do not group over ", KVH, " KV heads");
  TORCH_CHECK(layer >= 0 && layer < s0.size(0), "paged_decode_attention: layer ", layer, " out of range");
  TORCH_CHECK(segment_of.scalar_type() == at::kLong && slot_of.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong,
              "paged_decode_attention: int64 segment_of, slot_of and lens expected");
  TORCH_CHECK(segment_of.dim() == 2 && segment_of.size(0) == B && slot_of.sizes() == segment_of.sizes() &&
                  lens.numel() == B,
              "paged_decode_attention: segment_of/slot_of [B, L] and lens [B] expected");
  const int64_t L = segment_of.size(1);
  std::vector<const float*> k_base(segments.size()), v_base(segments.size());
  std::vector<int64_t> seg_slots(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    TORCH_CHECK(s.is_contiguous() && s.scalar_type() == at::kFloat && s.dim() == 5 && s.size(3) == KVH &&
                    s.size(4) == D && s.size(0) == s0.size(0),
                "paged_decode_attention: segment ", i, " is not a contiguous fp32 [layers, 2, slots, ", KVH, ", ", D,
                "] tensor");
    const int64_t slots = s.size(2);
    const float* base = s.data_ptr<float>() + layer * 2 * slots * KVH * D;
    k_base[i] = base;
    v_base[i] = base + slots * KVH * D;
    seg_slots[i] = slots;
  }
  const at::Tensor qc = q.contiguous();
  const int64_t* segp = segment_of.contiguous().data_ptr<int64_t>();
  const int64_t* slotp = slot_of.contiguous().data_ptr<int64_t>();
  const int64_t* lenp = lens.contiguous().data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lenp[b] >= 1 && lenp[b] <= L, "paged_decode_attention: length ", lenp[b], " of row ", b,
                " outside [1, ", L, "]");
    for (int64_t t = 0; t < lenp[b]; ++t) {
      const int64_t s = segp[b * L + t], slot = slotp[b * L + t];
      TORCH_CHECK(s >= 0 && s < (int64_t)segments.size() && slot >= 0 && slot < seg_slots[s],
                  "paged_decode_attention: row ", b, " position ", t, " points outside the pool");
    }
  }
  at::Tensor out = at::empty({B, H, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH, n = lenp[b];
      scores.assign(G * n, 0.f);
      const float* qg = qp + (b * H + kvh * G) * D;  // the G query heads that share this KV head
      for (int64_t t = 0; t < n; ++t) {
        const int64_t s = segp[b * L + t];
        const float* k = k_base[s] + (slotp[b * L + t] * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qh = qg + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
          scores[g * n + t] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * n;
        const float mx = *std::max_element(row, row + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) sum += (row[t] = std::exp(row[t] - mx));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) row[t] *= inv;
      }
      float* og = op + (b * H + kvh * G) * D;
      std::fill(og, og + G * D, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t s = segp[b * L + t];
        const float* v = v_base[s] + (slotp[b * L + t] * KVH + kvh) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* __restrict o = og + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor[] segments, Tensor segment_of, Tensor slot_of, Tensor lens, "
        "int layer, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
