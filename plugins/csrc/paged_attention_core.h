// Decode attention over the paged KV pool, one (sequence, KV head) task at a time: shared by the per-op kernels
// (paged_decode_attention.cpp, which says why) and the fused decode layer (decode_layer.cpp), so both give
// bitwise the same outputs.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx2_math.h"
#include "cpu_tile.h"

namespace morphserve_cpu {
namespace attn {


constexpr int64_t kMaxHalfHeadDim = 512;  // the fp16 pool's staging buffer for a new key (rope_and_write)

// One layer's keys and values in every segment: slot s of segment i holds [KVH, D] elements at k[i] + s*KVH*D,
// fp32 or fp16 (the pool's dtype; fp16 halves the bytes a decode step reads and each block's memory; the
// arithmetic is fp32 either way: fp16 widens exactly on load and the new token's K/V round to nearest on store).
struct LayerKV {
  std::vector<void*> k, v;
  std::vector<int64_t> slots;
  int64_t kv_heads = 0, head_dim = 0, num_layers = 0, layer = 0;
  bool half = false;
  template <typename T>
  T* key(int64_t seg) const { return static_cast<T*>(k[seg]); }
  template <typename T>
  T* value(int64_t seg) const { return static_cast<T*>(v[seg]); }
  int64_t elem_size() const { return half ? 2 : 4; }
};

inline LayerKV layer_kv(at::TensorList segments, int64_t layer, const char* op) {
  TORCH_CHECK(!segments.empty(), op, ": no KV segments");
  const auto& s0 = segments[0];
  TORCH_CHECK(s0.dim() == 5, op, ": segments [layers, 2, slots, KVH, D] expected");
  TORCH_CHECK(layer >= 0 && layer < s0.size(0), op, ": layer ", layer, " out of range");
  LayerKV kv;
  kv.kv_heads = s0.size(3);
  kv.head_dim = s0.size(4);
  kv.num_layers = s0.size(0);
  kv.layer = layer;
  TORCH_CHECK(s0.scalar_type() == at::kFloat || s0.scalar_type() == at::kHalf, op,
              ": fp32 or fp16 KV segments expected, got ", s0.scalar_type());
  kv.half = s0.scalar_type() == at::kHalf;
  // Checked here, before any write: rope_and_write stages an fp16 pool's new key in a stack buffer, and it runs
  // inside the fused layer's parallel region, where nothing may throw.
  TORCH_CHECK(!kv.half || kv.head_dim <= kMaxHalfHeadDim, op, ": head_dim ", kv.head_dim, " above ",
              kMaxHalfHeadDim, " with an fp16 pool");
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    TORCH_CHECK(s.is_contiguous() && s.scalar_type() == s0.scalar_type() && s.dim() == 5 &&
                    s.size(3) == kv.kv_heads && s.size(4) == kv.head_dim && s.size(0) == s0.size(0),
                op, ": segment ", i, " is not a contiguous ", s0.scalar_type(), " [layers, 2, slots, ", kv.kv_heads,
                ", ", kv.head_dim, "] tensor like segment 0");
    const int64_t slots = s.size(2);
    char* base = static_cast<char*>(s.data_ptr()) + layer * 2 * slots * kv.kv_heads * kv.head_dim * kv.elem_size();
    kv.k.push_back(base);
    kv.v.push_back(base + slots * kv.kv_heads * kv.head_dim * kv.elem_size());
    kv.slots.push_back(slots);
  }
  return kv;
}

// The same segments (checked by layer_kv) at another layer: only the per-segment offsets move.
inline LayerKV at_layer(const LayerKV& kv, int64_t layer, const char* op) {
  TORCH_CHECK(layer >= 0 && layer < kv.num_layers, op, ": layer ", layer, " out of range");
  LayerKV out = kv;
  for (size_t i = 0; i < kv.k.size(); ++i) {
    const int64_t step = (layer - kv.layer) * 2 * kv.slots[i] * kv.kv_heads * kv.head_dim * kv.elem_size();
    out.k[i] = static_cast<char*>(kv.k[i]) + step;
    out.v[i] = static_cast<char*>(kv.v[i]) + step;
  }
  out.layer = layer;
  return out;
}

// Every row's positions [0, lens[b]) point inside the pool: checked before anything is read or written.
inline void check_positions(const LayerKV& kv, const int64_t* segp, const int64_t* slotp, const int64_t* lenp, int64_t B,
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

inline Positions positions(const at::Tensor& segment_of, const at::Tensor& slot_of, const at::Tensor& lens, int64_t B,
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

// Process-wide: whether the passes over the cached keys and values ask for the rows ahead (kv_prefetch op: A/B
// measurements). A KV head's rows are D elements every KVH * D of a slot, and a sequence's slots hop from block
// to block, so the hardware prefetcher keeps few of them in flight: one core read the 30 layers' fp32 K/V at 512
// positions at 8.4 GB/s and at 2048 (fp16) at 4.0 GB/s. Asking for the rows ~8 KB ahead into L2 (prefetch_line)
// read them at 15-17 and 10-11 GB/s (T0, into L1: 8-13; 16 keys ahead in either: at most 13; 32 and 64 fp32
// keys alike). Bitwise the same results either way.
inline std::atomic<int> use_kv_prefetch{1};
constexpr int64_t kKVAheadBytes = 8192;

// How many keys on a pass asks for (0: none), read once per pass (a load in the loops costs registers).
template <typename T>
inline int64_t kv_keys_ahead(int64_t D) {
  if (!use_kv_prefetch.load(std::memory_order_relaxed)) return 0;
  return std::max<int64_t>(8, kKVAheadBytes / (D * static_cast<int64_t>(sizeof(T))));
}

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) prefetch_line(c + b);
}

// The horizontal sums of a, b, c and d as [a, b, c, d], each by hsum's own tree ((v0 + v4) + (v2 + v6)) +
// ((v1 + v5) + (v3 + v7)): a key's score has the same bits whichever keys share its pass, and the bits of the
// one-key-at-a-time loop this replaced.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_hadd_ps(t, t);  // [a c a c | b d b d]
  return _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Keys per pass of scores_avx for G query heads: KT * G accumulators (FMA chains) live at once, where one key at a
// time had G chains of D / 8 dependent FMAs. With values_heads, a (row, KV head) task's cost per cached position
// on one core, its K/V in L2 (256 positions, fp32): 20 -> 16 ns (docs/fused-decode.md).
template <int G>
constexpr int keys_per_pass() { return G <= 3 ? 4 : (G <= 5 ? 2 : 1); }

// scores[g * n + t] = (q_g . k_t) * sc for the G query heads of one KV head: each key is read once for all G.
template <int G, typename T>
inline void scores_avx(const float* qg, const T* const* keys, int64_t n, int64_t D, float sc, float* scores) {
  constexpr int KT = keys_per_pass<G>();
  const __m256 zero = _mm256_setzero_ps();
  const __m128 scale = _mm_set1_ps(sc);
  const int64_t ahead = kv_keys_ahead<T>(D);
  for (int64_t t = 0; t < n; t += KT) {
    const int64_t cnt = std::min<int64_t>(KT, n - t);
    const T* k[KT];
    for (int j = 0; j < KT; ++j) k[j] = keys[t + std::min<int64_t>(j, cnt - 1)];  // a short last pass repeats a key
    if (ahead > 0 && t + ahead + KT <= n)
      for (int j = 0; j < KT; ++j) prefetch_row(keys[t + ahead + j], D);
    __m256 acc[KT][G];
    for (int j = 0; j < KT; ++j)
      for (int g = 0; g < G; ++g) acc[j][g] = zero;
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qv[G];
      for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(qg + g * D + d);
      for (int j = 0; j < KT; ++j) {
        const __m256 kv = load8(k[j] + d);
        for (int g = 0; g < G; ++g) acc[j][g] = _mm256_fmadd_ps(qv[g], kv, acc[j][g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      __m256 four[4] = {zero, zero, zero, zero};  // a pass of fewer than 4 keys sums zeros beside them
      for (int j = 0; j < KT; ++j) four[j] = acc[j][g];
      const __m128 r = _mm_mul_ps(hsum4(four[0], four[1], four[2], four[3]), scale);
      float* out = scores + g * n + t;
      if (cnt == 4) {
        _mm_storeu_ps(out, r);
      } else {
        alignas(16) float part[4];
        _mm_store_ps(part, r);
        for (int64_t j = 0; j < cnt; ++j) out[j] = part[j];
      }
    }
  }
}

// Any G and D (the vector path needs D % 8 == 0 and G <= 8).
template <typename T>
inline void scores_scalar(const float* qg, const T* const* keys, int64_t n, int64_t G, int64_t D, float sc, float* scores) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += qg[g * D + d] * load1(keys[t] + d);
      scores[g * n + t] = dot * sc;
    }
}

inline void softmax_rows(float* scores, int64_t G, int64_t n) {
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

// Output floats [d0, d1) of o_g = sum_t p[g, t] v_t for the G heads of one KV head (d0, d1 multiples of 8). Each
// output is one FMA chain over t in order, whatever the chunking, so the bits do not depend on it (and are the
// one-head-at-a-time loop's that this replaced).
// Up to 4 heads go together, CW vectors of each at once: a value row is read and widened once for all G, not G
// times. More heads go one at a time, 64 floats (8 vectors) at once.
template <int G, int CW, typename T>
inline void values_heads(const float* probs, const T* const* vals, int64_t n, int64_t d0, int64_t d1, int64_t D,
                         float* og) {
  const int64_t ahead = kv_keys_ahead<T>(D);
  int64_t d = d0;
  for (; d + 8 * CW <= d1; d += 8 * CW) {
    __m256 acc[G][CW];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CW; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      if (ahead > 0 && t + ahead < n) prefetch_row(vals[t + ahead] + d, 8 * CW);
      __m256 pv[G];
      for (int g = 0; g < G; ++g) pv[g] = _mm256_set1_ps(probs[g * n + t]);
      const T* v = vals[t] + d;
      for (int c = 0; c < CW; ++c) {
        const __m256 vv = load8(v + 8 * c);
        for (int g = 0; g < G; ++g) acc[g][c] = _mm256_fmadd_ps(pv[g], vv, acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CW; ++c) _mm256_storeu_ps(og + g * D + d + 8 * c, acc[g][c]);
  }
  if (CW > 1 && d < d1) values_heads<G, 1>(probs, vals, n, d, d1, D, og);
}

template <typename T>
inline void values_avx(const float* probs, const T* const* vals, int64_t n, int64_t G, int64_t D, float* og) {
  switch (G) {
    case 1: values_heads<1, 8>(probs, vals, n, 0, D, D, og); return;
    case 2: values_heads<2, 4>(probs, vals, n, 0, D, D, og); return;
    case 3: values_heads<3, 4>(probs, vals, n, 0, D, D, og); return;
    case 4: values_heads<4, 2>(probs, vals, n, 0, D, D, og); return;
    default:
      for (int64_t g = 0; g < G; ++g) values_heads<1, 8>(probs + g * n, vals, n, 0, D, D, og + g * D);
  }
}

template <typename T>
inline void values_scalar(const float* probs, const T* const* vals, int64_t n, int64_t G, int64_t D, float* og) {
  std::fill(og, og + G * D, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) og[g * D + d] += probs[g * n + t] * load1(vals[t] + d);
}

// out [B, H, D] = softmax(q k^T * scale) v for every row over its lens[b] cached positions.
// Per-thread scratch of attend_task.
struct Scratch {
  std::vector<float> scores;
  std::vector<const void*> keys, vals;
};

// Task b * KVH + kvh: the G query heads of row b that share KV head kvh, over its lens[b] cached positions.
template <typename T>
inline void attend_task_as(int64_t task, const float* qp, float* op, int64_t H, const LayerKV& kv, const Positions& pos,
                           float sc, Scratch& w) {
  const int64_t KVH = kv.kv_heads, D = kv.head_dim, G = H / KVH, L = pos.L;
  const int64_t b = task / KVH, kvh = task % KVH, n = pos.len[b];
  w.keys.resize(n);
  w.vals.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t s = pos.seg[b * L + t], off = (pos.slot[b * L + t] * KVH + kvh) * D;
    w.keys[t] = kv.key<T>(s) + off;
    w.vals[t] = kv.value<T>(s) + off;
  }
  const T* const* keys = reinterpret_cast<const T* const*>(w.keys.data());
  const T* const* vals = reinterpret_cast<const T* const*>(w.vals.data());
  w.scores.resize(G * n);
  const float* qg = qp + (b * H + kvh * G) * D;
  float* og = op + (b * H + kvh * G) * D;
  float* scores = w.scores.data();
  if (!(D % 8 == 0 && G >= 1 && G <= 8)) {
    scores_scalar(qg, keys, n, G, D, sc, scores);
    softmax_rows(scores, G, n);
    values_scalar(scores, vals, n, G, D, og);
    return;
  }
  switch (G) {
    case 1: scores_avx<1>(qg, keys, n, D, sc, scores); break;
    case 2: scores_avx<2>(qg, keys, n, D, sc, scores); break;
    case 3: scores_avx<3>(qg, keys, n, D, sc, scores); break;
    case 4: scores_avx<4>(qg, keys, n, D, sc, scores); break;
    case 5: scores_avx<5>(qg, keys, n, D, sc, scores); break;
    case 6: scores_avx<6>(qg, keys, n, D, sc, scores); break;
    case 7: scores_avx<7>(qg, keys, n, D, sc, scores); break;
    default: scores_avx<8>(qg, keys, n, D, sc, scores); break;
  }
  softmax_rows(scores, G, n);
  values_avx(scores, vals, n, G, D, og);
}

inline void attend_task(int64_t task, const float* qp, float* op, int64_t H, const LayerKV& kv, const Positions& pos,
                        float sc, Scratch& w) {
  if (kv.half) attend_task_as<uint16_t>(task, qp, op, H, kv, pos, sc, w);
  else attend_task_as<float>(task, qp, op, H, kv, pos, sc, w);
}

// Half-split RoPE (the HF layout the fragments use): [x1, x2] -> [x1 c - x2 s, x2 c + x1 s].
inline void rope(const float* x, const float* c, const float* s, float* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * c[i] - x2 * s[i];
    out[i + half] = x2 * c[i] + x1 * s[i];
  }
}

// n floats into a pool slot: a copy, or fp16 rounded to nearest even (as torch's cast to float16).
inline void store_kv(const float* x, float* out, int64_t n) { std::memcpy(out, x, n * sizeof(float)); }
inline void store_kv(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}


// From row b of the fused q|k|v projection: RoPE on the G query heads of KV head kvh into q [B, H, D], and the
// new token's K (RoPE'd) and V of that head into its pool slot (the row's last position).
inline void rope_and_write(const float* qkv, const float* cos, const float* sin, float* qp, int64_t b, int64_t kvh,
                           int64_t H, const LayerKV& kv, const Positions& pos) {
  const int64_t KVH = kv.kv_heads, D = kv.head_dim, half = D / 2, G = H / KVH;
  const float *row = qkv + b * (H + 2 * KVH) * D, *cb = cos + b * half, *sb = sin + b * half;
  for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) rope(row + h * D, cb, sb, qp + (b * H + h) * D, half);
  const int64_t t = pos.len[b] - 1, seg = pos.seg[b * pos.L + t], slot = pos.slot[b * pos.L + t];
  const int64_t off = (slot * KVH + kvh) * D;
  if (!kv.half) {
    rope(row + (H + kvh) * D, cb, sb, kv.key<float>(seg) + off, half);
    store_kv(row + (H + KVH + kvh) * D, kv.value<float>(seg) + off, D);
    return;
  }
  float k[kMaxHalfHeadDim];  // head_dim checked by layer_kv
  rope(row + (H + kvh) * D, cb, sb, k, half);
  store_kv(k, kv.key<uint16_t>(seg) + off, D);
  store_kv(row + (H + KVH + kvh) * D, kv.value<uint16_t>(seg) + off, D);
}

}  // namespace attn
}  // namespace morphserve_cpu
