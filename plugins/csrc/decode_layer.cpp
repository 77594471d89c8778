// A whole decoder layer for a pure decode step in one call: RMSNorm, the fused q|k|v projection, RoPE, the new
// K/V's pool write and paged attention, the o projection, the residual add with the next RMSNorm, gate|up,
// SwiGLU, down and the last residual add.
//
// Why: the per-op path makes ~9 torch.ops calls per layer and step (270 for SmolLM2's 30 layers), each paying
// the dispatcher and, when it goes parallel, an OpenMP fork and join. At batch 1 that overhead was ~29% on top
// of the matmuls (step/matmuls 1.29). Here one OpenMP parallel region spans the layer: each phase splits its
// work over the team (linears by blocks of output columns, attention by (row, KV head), row-wise ops by rows)
// and a barrier separates dependent phases. With one thread there is no region at all.
//
// The arithmetic is the per-op kernels' own (cpu_tile.h, int4_tile.h, row_ops.h, paged_attention_core.h): each
// output is computed by the same loop in the same order whatever the thread split, so a layer's result is
// bitwise the per-op path's, and a row's result does not depend on its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <vector>

#include "cpu_tile.h"
#include "int4_tile.h"
#include "paged_attention_core.h"
#include "row_ops.h"

namespace {

namespace int4 = morphserve_cpu::int4;
using morphserve_cpu::add_row;
using morphserve_cpu::rms_norm_row;
using morphserve_cpu::silu_mul_row;
using namespace morphserve_cpu::attn;

constexpr int64_t kDense = 0, kInt4 = 1;  // linear kinds in `meta`
constexpr const char* kOp = "decode_layer";

// One of the layer's linears: dense (fp32 or fp16-stored weight [N, K]) or INT4 (int4_pack's blocks).
struct Linear {
  int64_t kind = kDense, N = 0, K = 0;
  const float* wf = nullptr;
  const uint16_t* wh = nullptr;
  int4::Packed p{};
  const float* pre_scale = nullptr;
  // INT4's prepared input (int4::prepare_input): [M * K] scaled (with a pre-scale), [M * groups], [M * K].
  std::vector<float> scaled, xsum, xs;

  int64_t units() const { return kind == kDense ? morphserve_cpu::num_blocks(N) : int4::num_tiles(p); }

  // Row r of this linear's input x [M, K], before the matmul: INT4 prepares it (one row alone gives the same
  // values as all rows at once: every step is per row).
  void prepare_row(const float* x, int64_t r) {
    if (kind != kInt4) return;
    const int64_t G = p.G;
    int4::prepare_input(x + r * K, 1, K, G, pre_scale, scaled.data() + (pre_scale ? r * K : 0),
                        xsum.data() + r * p.groups, xs.data() + r * K);
  }

  // Output units [u0, u1) of y [M, N] = x [M, K] @ W^T (x already prepared for INT4).
  void run(const float* x, int64_t M, float* y, int64_t u0, int64_t u1) const {
    thread_local std::vector<float> buf;
    if (kind == kInt4) int4::run_tiles(p, u0, u1, xs.data(), M, xsum.data(), y, N, buf);
    else if (wh != nullptr) morphserve_cpu::dense_blocks(x, M, wh, K, y, N, u0, u1, buf);
    else morphserve_cpu::dense_blocks(x, M, wf, K, y, N, u0, u1, buf);
  }
};

Linear linear_of(at::TensorList w, int64_t kind, int64_t N, int64_t G, int64_t K, int64_t M,
                 const char* name) {
  Linear l;
  l.kind = kind;
  l.N = N;
  l.K = K;
  if (kind == kDense) {
    const at::Tensor& t = w[0];
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.size(0) == N && t.size(1) == K &&
                    (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
                kOp, ": ", name, " weight must be a contiguous fp32 or fp16 [", N, ", ", K, "] tensor, got ",
                t.scalar_type(), " ", t.sizes());
    if (t.scalar_type() == at::kHalf) l.wh = reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
    else l.wf = t.data_ptr<float>();
    return l;
  }
  TORCH_CHECK(kind == kInt4, kOp, ": ", name, " has unknown kind ", kind, " (0 dense, 1 int4)");
  TORCH_CHECK(M <= int4::kMaxRows, kOp, ": ", M, " rows exceed the INT4 skinny limit ", int4::kMaxRows);
  l.p = int4::check_packed(w[0], w[1], N, G);
  TORCH_CHECK(l.p.K == K, kOp, ": ", name, " packed weight takes ", l.p.K, " features, the layer gives ", K);
  if (w[2].numel() > 0) {
    TORCH_CHECK(w[2].scalar_type() == at::kFloat && w[2].dim() == 1 && w[2].size(0) == K && w[2].is_contiguous(),
                kOp, ": ", name, " pre_scale must be a contiguous fp32 [", K, "] vector");
    l.pre_scale = w[2].data_ptr<float>();
    l.scaled.resize(M * K);
  }
  l.xsum.resize(M * l.p.groups);
  l.xs.resize(M * K);
  return l;
}

// [a, b) of n units for thread tid of nt: a static split, so no scheduling state is shared.
inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

// `weights`: input_layernorm, post_attention_layernorm, then 3 tensors for each of qkv, o, gate_up, down
// (dense: weight and two empty tensors; INT4: packed, affine, pre_scale or an empty tensor). `meta`: for each
// linear (kind, out_features, group_size).
at::Tensor decode_layer(const at::Tensor& h_in, at::TensorList weights, at::IntArrayRef meta, const at::Tensor& cos,
                        const at::Tensor& sin, at::TensorList segments, const at::Tensor& segment_of,
                        const at::Tensor& slot_of, const at::Tensor& lens, int64_t layer, double scale,
                        int64_t num_heads, double eps_d) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat && h_in.device().is_cpu(), kOp,
              ": fp32 CPU h [B, hidden] expected, got ", h_in.scalar_type(), " ", h_in.sizes());
  TORCH_CHECK(weights.size() == 14 && meta.size() == 12, kOp, ": 14 weight tensors and 12 meta ints expected, got ",
              weights.size(), " and ", meta.size());
  const at::Tensor h = h_in.contiguous();
  const int64_t B = h.size(0), hidden = h.size(1);
  for (int i = 0; i < 2; ++i)
    TORCH_CHECK(weights[i].scalar_type() == at::kFloat && weights[i].dim() == 1 && weights[i].size(0) == hidden &&
                    weights[i].is_contiguous(),
                kOp, ": norm weight ", i, " must be a contiguous fp32 vector of ", hidden, " features");
  const LayerKV kv = layer_kv(segments, layer, kOp);
  const int64_t H = num_heads, KVH = kv.kv_heads, D = kv.head_dim, half = D / 2;
  TORCH_CHECK(H > 0 && H % KVH == 0, kOp, ": ", H, " query heads do not group over ", KVH, " KV heads");
  TORCH_CHECK(D % 2 == 0, kOp, ": RoPE needs an even head_dim, the pool has ", D);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->size(0) == B && t->size(1) == half, kOp,
                ": fp32 cos and sin [", B, ", ", half, "] expected, got ", t->sizes());
  const Positions pos = positions(segment_of, slot_of, lens, B, kOp);
  check_positions(kv, pos.seg, pos.slot, pos.len, B, pos.L, kOp);
  const int64_t qkv_n = meta[1], o_n = meta[4], gu_n = meta[7], down_n = meta[10];
  TORCH_CHECK(qkv_n == (H + 2 * KVH) * D, kOp, ": qkv gives ", qkv_n, " features, attention needs ", (H + 2 * KVH) * D);
  TORCH_CHECK(o_n == hidden && down_n == hidden, kOp, ": o and down must give ", hidden, " features, got ", o_n,
              " and ", down_n);
  TORCH_CHECK(gu_n % 2 == 0, kOp, ": gate_up gives an odd number of features (", gu_n, ")");
  const int64_t I = gu_n / 2;
  Linear qkv = linear_of(weights.slice(2, 3), meta[0], qkv_n, meta[2], hidden, B, "qkv");
  Linear o = linear_of(weights.slice(5, 3), meta[3], o_n, meta[5], H * D, B, "o");
  Linear gate_up = linear_of(weights.slice(8, 3), meta[6], gu_n, meta[8], hidden, B, "gate_up");
  Linear down = linear_of(weights.slice(11, 3), meta[9], down_n, meta[11], I, B, "down");

  at::Tensor out = at::empty({B, hidden}, h.options());
  if (B == 0) return out;
  // Intermediates, one arena: normed x, q|k|v, roped q, attention, o, h + o, its norm, gate|up, SwiGLU, down.
  std::vector<float> arena(B * (hidden + qkv_n + H * D + H * D + hidden + hidden + hidden + gu_n + I + hidden));
  float* xn = arena.data();
  float* qkv_y = xn + B * hidden;
  float* q = qkv_y + B * qkv_n;
  float* att = q + B * H * D;
  float* o_y = att + B * H * D;
  float* h2 = o_y + B * hidden;
  float* x2 = h2 + B * hidden;
  float* gu = x2 + B * hidden;
  float* act = gu + B * gu_n;
  float* dn = act + B * I;
  const float *hp = h.data_ptr<float>(), *n1 = weights[0].data_ptr<float>(), *n2 = weights[1].data_ptr<float>();
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const float *cp = cos_c.data_ptr<float>(), *sp = sin_c.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const float eps = static_cast<float>(eps_d), sc = static_cast<float>(scale);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), 64)));

  // The whole layer, run by each of the nt threads of a team; `sync` is the barrier between dependent phases.
  auto body = [&](int tid, int nt, auto&& sync) {
    int64_t a, b;
    share(B, tid, nt, a, b);
    for (int64_t r = a; r < b; ++r) {
      rms_norm_row(hp + r * hidden, n1, xn + r * hidden, hidden, eps);
      qkv.prepare_row(xn, r);
    }
    sync();
    share(qkv.units(), tid, nt, a, b);
    qkv.run(xn, B, qkv_y, a, b);
    sync();
    {
      Scratch w;
      share(B * KVH, tid, nt, a, b);
      for (int64_t task = a; task < b; ++task) {
        rope_and_write(qkv_y, cp, sp, q, task / KVH, task % KVH, H, kv, pos);
        attend_task(task, q, att, H, kv, pos, sc, w);
      }
    }
    sync();
    if (o.kind == kInt4) {
      share(B, tid, nt, a, b);
      for (int64_t r = a; r < b; ++r) o.prepare_row(att, r);
      sync();
    }
    share(o.units(), tid, nt, a, b);
    o.run(att, B, o_y, a, b);
    sync();
    share(B, tid, nt, a, b);
    for (int64_t r = a; r < b; ++r) {
      add_row(hp + r * hidden, o_y + r * hidden, h2 + r * hidden, hidden);
      rms_norm_row(h2 + r * hidden, n2, x2 + r * hidden, hidden, eps);
      gate_up.prepare_row(x2, r);
    }
    sync();
    share(gate_up.units(), tid, nt, a, b);
    gate_up.run(x2, B, gu, a, b);
    sync();
    share(B, tid, nt, a, b);
    for (int64_t r = a; r < b; ++r) {
      silu_mul_row(gu + r * gu_n, act + r * I, I);
      down.prepare_row(act, r);
    }
    sync();
    share(down.units(), tid, nt, a, b);
    down.run(act, B, dn, a, b);
    sync();
    share(B, tid, nt, a, b);
    for (int64_t r = a; r < b; ++r) add_row(h2 + r * hidden, dn + r * hidden, outp + r * hidden, hidden);
  };
  if (nt == 1) {
    body(0, 1, [] {});
  } else {
#pragma omp parallel num_threads(nt)
    body(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("decode_layer(Tensor h, Tensor[] weights, int[] meta, Tensor cos, Tensor sin, Tensor(a!)[] segments, "
        "Tensor segment_of, Tensor slot_of, Tensor lens, int layer, float scale, int num_heads, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("decode_layer", decode_layer); }
