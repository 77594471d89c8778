// Paged attention for decode rows on the CPU: one new query token per sequence against its cached keys and
// values, read in place from the pool's segments (no gather copy, no padding, no mask).
//
// Why: in torch a decode step's attention per layer is ~6 ops (gather K, gather V, select q, masked SDPA over
// the padded batch, scatter the output); at SmolLM2's sizes each costs more in dispatch than in arithmetic.
// Here one task per (sequence, KV head) walks that sequence's slots once for scores and once for values.
// Every sequence is computed alone, in the same order, so its result does not depend on the batch.
//
// Two entry points share the attention:
// - paged_decode_attention(q, ...): q already has RoPE applied and the new K/V are already in the pool
//   (decode rows inside a step that also runs prefill chunks).
// - paged_decode_attention_qkv(qkv, cos, sin, ...): a pure decode step. From the fused q|k|v projection it
//   applies RoPE to q and k, writes the new token's K and V to its slot (the last position of each row), and
//   attends: the ~15 small torch ops of RoPE, casts and the pool write become part of this one call.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx2_math.h"
#include "cpu_tile.h"

namespace {

using morphserve_cpu::exp256;
using morphserve_cpu::hsum;

// One layer's keys and values in every segment: slot s of segment i holds [KVH, D] floats at k[i] + s*KVH*D.
struct LayerKV {
  std::vector<float*> k, v;
  std::vector<int64_t> slots;
  int64_t kv_heads = 0, head_dim = 0;
};

LayerKV layer_kv(at::TensorList segments, int64_t layer, const char* op) {
  TORCH_CHECK(!segments.empty(), op, ": no KV segments");
  const auto& s0 = segments[0];
  TORCH_CHECK(s0.dim() == 5, op, ": segments [layers, 2, slots, KVH, D] expected");
  TORCH_CHECK(layer >= 0 && layer < s0.size(0), op, ": layer ", layer, " out of range");
  LayerKV kv;
  kv.kv_heads = s0.size(3);
  kv.head_dim = s0.size(4);
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    TORCH_CHECK(s.is_contiguous() && s.scalar_type() == at::kFloat && s.dim() == 5 && s.size(3) == kv.kv_heads &&
                    s.size(4) == kv.head_dim && s.size(0) == s0.size(0),
                op, ": segment ", i, " is not a contiguous fp32 [layers, 2, slots, ", kv.kv_heads, ", ",
                kv.head_dim, "] tensor");
    const int64_t slots = s.size(2);
    float* base = s.data_ptr<float>() + layer * 2 * slots * kv.kv_heads * kv.head_dim;
    kv.k.push_back(base);
    kv.v.push_back(base + slots * kv.kv_heads * kv.head_dim);
    kv.slots.push_back(slots);
  }
  return kv;
}

// Every row's positions [0, lens[b]) point inside the pool: checked before anything is read or written.
void check_positions(const LayerKV& kv, const int64_t* segp, const int64_t* slotp, const int64_t* lenp, int64_t B,
                     int64_t L, const char* op) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lenp[b] >= 1 && lenp[b] <= L, op, ": length ", lenp[b], " of row ", b, " outside [1, ", L, "]");
    for (int64_t t = 0; t < lenp[b]; ++t) {
      const int64_t s = segp[b * L + t], slot = slotp[b * L + t];
      TORCH_CHECK(s >= 0 && s < (int64_t)kv.slots.size() && slot >= 0 && slot < kv.slots[s], op, ": row ", b,
                  " position ", t, " points outside the pool");
    }
  }
}

struct Positions {
  at::Tensor segment_of, slot_of, lens;  // contiguous copies kept alive while the pointers are used
  const int64_t *seg, *slot, *len;
  int64_t L;
};

Positions positions(const at::Tensor& segment_of, const at::Tensor& slot_of, const at::Tensor& lens, int64_t B,
                    const char* op) {
  TORCH_CHECK(segment_of.scalar_type() == at::kLong && slot_of.scalar_type() == at::kLong &&
                  lens.scalar_type() == at::kLong,
              op, ": int64 segment_of, slot_of and lens expected");
  TORCH_CHECK(segment_of.dim() == 2 && segment_of.size(0) == B && slot_of.sizes() == segment_of.sizes() &&
                  lens.numel() == B,
              op, ": segment_of/slot_of [B, L] and lens [B] expected");
  Positions p{segment_of.contiguous(), slot_of.contiguous(), lens.contiguous(), nullptr, nullptr, nullptr,
              segment_of.size(1)};
  p.seg = p.segment_of.data_ptr<int64_t>();
  p.slot = p.slot_of.data_ptr<int64_t>();
  p.len = p.lens.data_ptr<int64_t>();
  return p;
}

// scores[g * n + t] = (q_g . k_t) * sc for the G query heads of one KV head: each key is read once for all G.
template <int G>
void scores_avx(const float* qg, const float* const* keys, int64_t n, int64_t D, float sc, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys[t];
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + g * D + d), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * n + t] = hsum(acc[g]) * sc;
  }
}

// Any G and D (the vector path needs D % 8 == 0 and G <= 8).
void scores_scalar(const float* qg, const float* const* keys, int64_t n, int64_t G, int64_t D, float sc, float* scores) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qg[g * D + d] * keys[t][d];
      scores[g * n + t] = dot * sc;
    }
}

void softmax_rows(float* scores, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * n;
    const float mx = *std::max_element(row, row + n);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + t), vmx));
      _mm256_storeu_ps(row + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; t < n; ++t) sum += (row[t] = std::exp(row[t] - mx));
    const float inv = 1.f / sum;
    for (t = 0; t < n; ++t) row[t] *= inv;
  }
}

// o_g = sum_t p[g, t] v_t, a head's output kept in registers 64 floats at a time.
void values_avx(const float* probs, const float* const* vals, int64_t n, int64_t G, int64_t D, float* og) {
  constexpr int64_t kChunk = 64;
  for (int64_t g = 0; g < G; ++g) {
    const float* p = probs + g * n;
    float* o = og + g * D;
    int64_t d0 = 0;
    for (; d0 + kChunk <= D; d0 += kChunk) {
      __m256 acc[kChunk / 8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const __m256 pv = _mm256_set1_ps(p[t]);
        const float* v = vals[t] + d0;
#pragma GCC unroll 8
        for (int j = 0; j < kChunk / 8; ++j) acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * j), acc[j]);
      }
      for (int j = 0; j < kChunk / 8; ++j) _mm256_storeu_ps(o + d0 + 8 * j, acc[j]);
    }
    for (; d0 < D; d0 += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t t = 0; t < n; ++t) acc = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(vals[t] + d0), acc);
      _mm256_storeu_ps(o + d0, acc);
    }
  }
}

void values_scalar(const float* probs, const float* const* vals, int64_t n, int64_t G, int64_t D, float* og) {
  std::fill(og, og + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) og[g * D + d] += probs[g * n + t] * vals[t][d];
}

// out [B, H, D] = softmax(q k^T * scale) v for every row over its lens[b] cached positions.
void attend(const float* qp, float* op, int64_t B, int64_t H, const LayerKV& kv, const Positions& pos, float sc) {
  const int64_t KVH = kv.kv_heads, D = kv.head_dim, G = H / KVH, L = pos.L;
  const bool vec = D % 8 == 0 && G >= 1 && G <= 8;
  // A short attention (a few sequences, short contexts) is cheaper on this thread than the ~20 us it takes to
  // wake a second one: go parallel only from ~kParallelDots dot products of head_dim upwards.
  constexpr int64_t kParallelDots = 4096;
  int64_t dots = 0;
  for (int64_t b = 0; b < B; ++b) dots += pos.len[b] * H;
  const int64_t grain = dots < kParallelDots ? B * KVH : 1;
  at::parallel_for(0, B * KVH, grain, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    std::vector<const float*> keys, vals;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / KVH, kvh = task % KVH, n = pos.len[b];
      keys.resize(n);
      vals.resize(n);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t s = pos.seg[b * L + t], off = (pos.slot[b * L + t] * KVH + kvh) * D;
        keys[t] = kv.k[s] + off;
        vals[t] = kv.v[s] + off;
      }
      scores.resize(G * n);
      const float* qg = qp + (b * H + kvh * G) * D;  // the G query heads that share this KV head
      float* og = op + (b * H + kvh * G) * D;
      if (!vec) {
        scores_scalar(qg, keys.data(), n, G, D, sc, scores.data());
        softmax_rows(scores.data(), G, n);
        values_scalar(scores.data(), vals.data(), n, G, D, og);
        continue;
      }
      switch (G) {
        case 1: scores_avx<1>(qg, keys.data(), n, D, sc, scores.data()); break;
        case 2: scores_avx<2>(qg, keys.data(), n, D, sc, scores.data()); break;
        case 3: scores_avx<3>(qg, keys.data(), n, D, sc, scores.data()); break;
        case 4: scores_avx<4>(qg, keys.data(), n, D, sc, scores.data()); break;
        case 5: scores_avx<5>(qg, keys.data(), n, D, sc, scores.data()); break;
        case 6: scores_avx<6>(qg, keys.data(), n, D, sc, scores.data()); break;
        case 7: scores_avx<7>(qg, keys.data(), n, D, sc, scores.data()); break;
        default: scores_avx<8>(qg, keys.data(), n, D, sc, scores.data()); break;
      }
      softmax_rows(scores.data(), G, n);
      values_avx(scores.data(), vals.data(), n, G, D, og);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, at::TensorList segments, const at::Tensor& segment_of,
                                  const at::Tensor& slot_of, const at::Tensor& lens, int64_t layer, double scale) {
  constexpr const char* op = "paged_decode_attention";
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, op, ": fp32 q [B, H, D] expected");
  const LayerKV kv = layer_kv(segments, layer, op);
  const int64_t B = q.size(0), H = q.size(1);
  TORCH_CHECK(q.size(2) == kv.head_dim, op, ": q has head_dim ", q.size(2), ", the pool ", kv.head_dim);
  TORCH_CHECK(H % kv.kv_heads == 0, op, ": ", H, " query heads do not group over ", kv.kv_heads, " KV heads");
  const Positions pos = positions(segment_of, slot_of, lens, B, op);
  check_positions(kv, pos.seg, pos.slot, pos.len, B, pos.L, op);
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({B, H, kv.head_dim}, qc.options());
  attend(qc.data_ptr<float>(), out.data_ptr<float>(), B, H, kv, pos, static_cast<float>(scale));
  return out;
}

// Half-split RoPE (the HF layout the fragments use): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s].
inline void rope(const float* x, const float* c, const float* s, float* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

at::Tensor paged_decode_attention_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList segments, const at::Tensor& segment_of, const at::Tensor& slot_of,
                                      const at::Tensor& lens, int64_t layer, double scale, int64_t num_heads) {
  constexpr const char* op = "paged_decode_attention_qkv";
  const LayerKV kv = layer_kv(segments, layer, op);
  const int64_t H = num_heads, KVH = kv.kv_heads, D = kv.head_dim, half = D / 2;
  TORCH_CHECK(H > 0 && H % KVH == 0, op, ": ", H, " query heads do not group over ", KVH, " KV heads");
  TORCH_CHECK(D % 2 == 0, op, ": RoPE needs an even head_dim, the pool has ", D);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.size(1) == (H + 2 * KVH) * D, op,
              ": fp32 qkv [B, ", (H + 2 * KVH) * D, "] (q | k | v) expected, got ", qkv.scalar_type(), " ",
              qkv.sizes());
  const int64_t B = qkv.size(0);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->size(0) == B && t->size(1) == half, op,
                ": fp32 cos and sin [", B, ", ", half, "] expected, got ", t->sizes());
  const Positions pos = positions(segment_of, slot_of, lens, B, op);
  check_positions(kv, pos.seg, pos.slot, pos.len, B, pos.L, op);
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  const float *xp = x.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  at::Tensor q = at::empty({B, H, D}, x.options());
  float* qp = q.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float *row = xp + b * (H + 2 * KVH) * D, *cb = cp + b * half, *sb = sp + b * half;
    for (int64_t h = 0; h < H; ++h) rope(row + h * D, cb, sb, qp + (b * H + h) * D, half);
    const int64_t t = pos.len[b] - 1, seg = pos.seg[b * pos.L + t], slot = pos.slot[b * pos.L + t];
    for (int64_t j = 0; j < KVH; ++j) {
      rope(row + (H + j) * D, cb, sb, kv.k[seg] + (slot * KVH + j) * D, half);
      std::memcpy(kv.v[seg] + (slot * KVH + j) * D, row + (H + KVH + j) * D, D * sizeof(float));
    }
  }
  at::Tensor out = at::empty({B, H * D}, x.options());
  attend(qp, out.data_ptr<float>(), B, H, kv, pos, static_cast<float>(scale));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor[] segments, Tensor segment_of, Tensor slot_of, Tensor lens, "
        "int layer, float scale) -> Tensor");
  m.def("paged_decode_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!)[] segments, Tensor segment_of, "
        "Tensor slot_of, Tensor lens, int layer, float scale, int num_heads) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("paged_decode_attention", paged_decode_attention);
  m.impl("paged_decode_attention_qkv", paged_decode_attention_qkv);
}
