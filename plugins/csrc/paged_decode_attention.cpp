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

#include "paged_attention_core.h"

namespace {

using namespace morphserve_cpu::attn;

// out [B, H, D] = softmax(q k^T * scale) v for every row over its lens[b] cached positions.
void attend(const float* qp, float* op, int64_t B, int64_t H, const LayerKV& kv, const Positions& pos, float sc) {
  const int64_t KVH = kv.kv_heads;
  // A short attention (a few sequences, short contexts) is cheaper on this thread than the ~20 us it takes to
  // wake a second one: go parallel only from ~kParallelDots dot products of head_dim upwards.
  constexpr int64_t kParallelDots = 4096;
  int64_t dots = 0;
  for (int64_t b = 0; b < B; ++b) dots += pos.len[b] * H;
  const int64_t grain = dots < kParallelDots ? B * KVH : 1;
  at::parallel_for(0, B * KVH, grain, [&](int64_t t0, int64_t t1) {
    Scratch w;
    for (int64_t task = t0; task < t1; ++task) attend_task(task, qp, op, H, kv, pos, sc, w);
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
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < KVH; ++j) rope_and_write(xp, cp, sp, qp, b, j, H, kv, pos);
  at::Tensor out = at::empty({B, H * D}, x.options());
  attend(qp, out.data_ptr<float>(), B, H, kv, pos, static_cast<float>(scale));
  return out;
}

// Lets the attention passes prefetch the cached K/V rows ahead (1) or not (0) when `on` >= 0; returns the
// setting before the call. The results are bitwise the same either way: this exists to measure.
int64_t kv_prefetch(int64_t on) {
  TORCH_CHECK(on >= -1 && on <= 1, "kv_prefetch: 0 (off), 1 (on) or -1 (read) expected, got ", on);
  const int previous = use_kv_prefetch.load();
  if (on >= 0) use_kv_prefetch.store(static_cast<int>(on));
  return previous;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("kv_prefetch(int on) -> int", kv_prefetch);  // no tensors: a catch-all kernel
  m.def("paged_decode_attention(Tensor q, Tensor[] segments, Tensor segment_of, Tensor slot_of, Tensor lens, "
        "int layer, float scale) -> Tensor");
  m.def("paged_decode_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!)[] segments, Tensor segment_of, "
        "Tensor slot_of, Tensor lens, int layer, float scale, int num_heads) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("paged_decode_attention", paged_decode_attention);
  m.impl("paged_decode_attention_qkv", paged_decode_attention_qkv);
}
