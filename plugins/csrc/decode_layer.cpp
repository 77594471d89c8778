// The decoder layers of a pure decode step in one call: per layer RMSNorm, the fused q|k|v projection, RoPE,
// the new K/V's pool write and paged attention, the o projection, the residual add with the next RMSNorm,
// gate|up, SwiGLU, down and the last residual add; the model passes all its layers at once.
//
// Why: the per-op path makes ~9 torch.ops calls per layer and step (270 for SmolLM2's 30 layers), each paying
// the dispatcher and, when it goes parallel, an OpenMP fork and join; at batch 1 that was ~29% on top of the
// matmuls (step/matmuls 1.29). Here one OpenMP parallel region spans the step: each phase splits its work over
// the team (linears by blocks of output columns, attention by (row, KV head), row-wise ops by rows, or at a few
// rows each thread all of them) and a barrier separates dependent phases (a layer's last phase and the next
// one's first split rows the same way, so they need none). With one thread there is no region at all. Arguments are parsed and checked once per
// call, not per layer (a call with 14 tensors costs ~10 us of parsing alone).
//
// The arithmetic is the per-op kernels' own (cpu_tile.h, int4_tile.h, row_ops.h, paged_attention_core.h): each
// output is computed by the same loop in the same order whatever the thread split, so the result is bitwise
// the per-op path's, and a row's result does not depend on its batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "bf16_tile.h"
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
constexpr int64_t kTensorsPerLayer = 14, kMetaPerLayer = 12;
constexpr const char* kOp = "decode_layers";

// An INT4 linear's prepared input (int4::prepare_input): one set serves every linear in turn, as each is
// prepared in the phase just before its own.
struct Prep {
  std::vector<float> scaled, xsum, xs, xd;
  std::vector<int8_t> xq;
  std::vector<uint16_t> xb;  // a bf16-stored dense linear's input rounded to bf16
};

// Rows up to which every thread does the row-wise phases itself (RowBuffers of its own, `own` in the body): the
// redundant work is a few rows' norms and prep, less than the barrier and the idle threads it saves.
constexpr int64_t kOwnRowsMax = 4;

// What the row-wise phases write, row by row: normed x, h + o and its norm, SwiGLU, the prepared INT4 input, and
// the two residual streams the layers pass along in turn. One set for the team, or one per thread.
struct RowBuffers {
  struct Sizes {
    int64_t B, hidden, max_k, max_groups, max_gu;
  };
  std::vector<float> arena;
  Prep prep;
  float *xn, *h2, *x2, *act, *stream[2];

  explicit RowBuffers(const Sizes& z) : arena(z.B * (5 * z.hidden + z.max_gu / 2)) {
    prep.scaled.resize(z.B * z.max_k);
    prep.xsum.resize(z.B * z.max_groups);
    prep.xs.resize(z.B * z.max_k);
    prep.xq.resize(z.B * z.max_k);
    prep.xd.resize(z.B * z.max_k / int4::kQBlock + 1);
    prep.xb.resize(z.B * z.max_k);
    xn = arena.data();
    h2 = xn + z.B * z.hidden;
    x2 = h2 + z.B * z.hidden;
    stream[0] = x2 + z.B * z.hidden;
    stream[1] = stream[0] + z.B * z.hidden;
    act = stream[1] + z.B * z.hidden;
  }
  RowBuffers(const RowBuffers&) = delete;
  RowBuffers& operator=(const RowBuffers&) = delete;
};

// One of a layer's linears: dense (fp32, fp16- or bf16-stored weight [N, K]) or INT4 (int4_pack's blocks).
struct Linear {
  int64_t kind = kDense, N = 0, K = 0;
  const float* wf = nullptr;
  const uint16_t* wh = nullptr;
  const uint16_t* wb = nullptr;  // bf16 storage: bf16 inputs, fp32 sums (bf16_tile.h)
  int4::Packed p{};
  const float* pre_scale = nullptr;

  int64_t units() const {
    if (kind == kInt4) return int4::num_tiles(p);
    return wb != nullptr ? morphserve_cpu::bf16::num_blocks(N) : morphserve_cpu::num_blocks(N);
  }

  // Whether the input is prepared row by row before the matmul (prepare_row).
  bool prepares() const { return kind == kInt4 || wb != nullptr; }

  // Row r of this linear's input x [M, K], before the matmul: INT4 prepares it (per row, as prepare_input
  // works row by row anyway), a bf16-stored weight rounds it to bf16.
  void prepare_row(const float* x, int64_t r, Prep& s) const {
    if (wb != nullptr) {
      morphserve_cpu::bf16::round_to_bf16(x + r * K, K, s.xb.data() + r * K);
      return;
    }
    if (kind != kInt4) return;
    const bool q8 = int4::int8_activations(K, p.G);
    int4::prepare_input(x + r * K, 1, K, p.G, pre_scale, s.scaled.data() + r * K, s.xsum.data() + r * p.groups,
                        s.xs.data() + r * K, q8 ? s.xq.data() + r * K : nullptr, s.xd.data() + r * (K / int4::kQBlock));
  }

  // Output units [u0, u1) of y [M, N] = x [M, K] @ W^T (x already prepared for INT4).
  void run(const float* x, int64_t M, float* y, int64_t u0, int64_t u1, const Prep& s) const {
    thread_local std::vector<float> buf;
    if (kind == kInt4) {
      const bool q8 = int4::int8_activations(K, p.G);
      int4::run_tiles(p, u0, u1, {s.xs.data(), s.xsum.data(), q8 ? s.xq.data() : nullptr, s.xd.data()}, M, y, N, buf);
    }
    else if (wb != nullptr) morphserve_cpu::bf16::bf16_blocks(s.xb.data(), M, wb, K, y, N, u0, u1);
    else if (wh != nullptr) morphserve_cpu::dense_blocks(x, M, wh, K, y, N, u0, u1, buf);
    else morphserve_cpu::dense_blocks(x, M, wf, K, y, N, u0, u1, buf);
  }
};

Linear linear_of(at::TensorList w, int64_t kind, int64_t N, int64_t G, int64_t K, int64_t M, int64_t layer,
                 const char* name) {
  Linear l;
  l.kind = kind;
  l.N = N;
  l.K = K;
  if (kind == kDense) {
    const at::Tensor& t = w[0];
    const auto dtype = t.scalar_type();
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.size(0) == N && t.size(1) == K &&
                    (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
                kOp, ": layer ", layer, " ", name, " weight must be a contiguous fp32, fp16 or bf16 [", N, ", ", K,
                "] tensor, got ", dtype, " ", t.sizes());
    TORCH_CHECK(dtype != at::kBFloat16 || morphserve_cpu::cpu_has_avx512_bf16(), kOp, ": layer ", layer, " ", name,
                ": a bf16 weight needs AVX512_BF16, which this CPU lacks");
    if (dtype == at::kHalf) l.wh = reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
    else if (dtype == at::kBFloat16) l.wb = reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
    else l.wf = t.data_ptr<float>();
    return l;
  }
  TORCH_CHECK(kind == kInt4, kOp, ": layer ", layer, " ", name, " has unknown kind ", kind, " (0 dense, 1 int4)");
  TORCH_CHECK(M <= int4::kMaxRows, kOp, ": ", M, " rows exceed the INT4 skinny limit ", int4::kMaxRows);
  l.p = int4::check_packed(w[0], w[1], N, G);
  TORCH_CHECK(l.p.K == K, kOp, ": layer ", layer, " ", name, " packed weight takes ", l.p.K, " features, the layer gives ", K);
  if (w[2].numel() > 0) {
    TORCH_CHECK(w[2].scalar_type() == at::kFloat && w[2].dim() == 1 && w[2].size(0) == K && w[2].is_contiguous(),
                kOp, ": layer ", layer, " ", name, " pre_scale must be a contiguous fp32 [", K, "] vector");
    l.pre_scale = w[2].data_ptr<float>();
  }
  return l;
}

struct Layer {
  const float *norm1, *norm2;
  Linear qkv, o, gate_up, down;
  LayerKV kv;
};

// [a, b) of n units for thread tid of nt: a static split, so no scheduling state is shared.
inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

// `weights`: per layer input_layernorm, post_attention_layernorm, then 3 tensors for each of qkv, o, gate_up,
// down (dense: weight and two empty tensors; INT4: packed, affine, pre_scale or an empty tensor). `meta`: per
// layer and linear (kind, out_features, group_size). `layers`: the pool layer of each.
at::Tensor decode_layers(const at::Tensor& h_in, at::TensorList weights, at::IntArrayRef meta, at::IntArrayRef layers,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList segments,
                         const at::Tensor& segment_of, const at::Tensor& slot_of, const at::Tensor& lens, double scale,
                         int64_t num_heads, double eps_d) {
  TORCH_CHECK(h_in.dim() == 2 && h_in.scalar_type() == at::kFloat && h_in.device().is_cpu(), kOp,
              ": fp32 CPU h [B, hidden] expected, got ", h_in.scalar_type(), " ", h_in.sizes());
  const int64_t n = static_cast<int64_t>(layers.size());
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(weights.size()) == n * kTensorsPerLayer &&
                  static_cast<int64_t>(meta.size()) == n * kMetaPerLayer,
              kOp, ": 14 weight tensors and 12 meta ints per layer expected for ", n, " layers, got ", weights.size(),
              " and ", meta.size());
  const at::Tensor h = h_in.contiguous();
  const int64_t B = h.size(0), hidden = h.size(1);
  const LayerKV kv0 = layer_kv(segments, layers[0], kOp);
  const int64_t H = num_heads, KVH = kv0.kv_heads, D = kv0.head_dim, half = D / 2;
  TORCH_CHECK(H > 0 && H % KVH == 0, kOp, ": ", H, " query heads do not group over ", KVH, " KV heads");
  TORCH_CHECK(D % 2 == 0, kOp, ": RoPE needs an even head_dim, the pool has ", D);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->size(0) == B && t->size(1) == half, kOp,
                ": fp32 cos and sin [", B, ", ", half, "] expected, got ", t->sizes());
  const Positions pos = positions(segment_of, slot_of, lens, B, kOp);
  check_positions(kv0, pos.seg, pos.slot, pos.len, B, pos.L, kOp);

  std::vector<Layer> plan;
  plan.reserve(n);
  int64_t max_k = 0, max_groups = 0, max_gu = 0;
  for (int64_t l = 0; l < n; ++l) {
    const at::TensorList w = weights.slice(l * kTensorsPerLayer, kTensorsPerLayer);
    const at::IntArrayRef m = meta.slice(l * kMetaPerLayer, kMetaPerLayer);
    for (int i = 0; i < 2; ++i)
      TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].dim() == 1 && w[i].size(0) == hidden && w[i].is_contiguous(),
                  kOp, ": layer ", layers[l], " norm weight ", i, " must be a contiguous fp32 vector of ", hidden,
                  " features");
    const int64_t qkv_n = m[1], o_n = m[4], gu_n = m[7], down_n = m[10];
    TORCH_CHECK(qkv_n == (H + 2 * KVH) * D, kOp, ": layer ", layers[l], " qkv gives ", qkv_n,
                " features, attention needs ", (H + 2 * KVH) * D);
    TORCH_CHECK(o_n == hidden && down_n == hidden, kOp, ": layer ", layers[l], " o and down must give ", hidden,
                " features, got ", o_n, " and ", down_n);
    TORCH_CHECK(gu_n > 0 && gu_n % 2 == 0, kOp, ": layer ", layers[l], " gate_up gives an odd number of features (",
                gu_n, ")");
    Layer L{w[0].data_ptr<float>(), w[1].data_ptr<float>(),
            linear_of(w.slice(2, 3), m[0], qkv_n, m[2], hidden, B, layers[l], "qkv"),
            linear_of(w.slice(5, 3), m[3], o_n, m[5], H * D, B, layers[l], "o"),
            linear_of(w.slice(8, 3), m[6], gu_n, m[8], hidden, B, layers[l], "gate_up"),
            linear_of(w.slice(11, 3), m[9], down_n, m[11], gu_n / 2, B, layers[l], "down"),
            at_layer(kv0, layers[l], kOp)};
    for (const Linear* x : {&L.qkv, &L.o, &L.gate_up, &L.down}) {
      if (x->prepares()) max_k = std::max(max_k, x->K);
      if (x->kind == kInt4) max_groups = std::max(max_groups, x->p.groups);
    }
    max_gu = std::max(max_gu, gu_n);
    plan.push_back(std::move(L));
  }

  at::Tensor out = at::empty({B, hidden}, h.options());
  if (B == 0) return out;
  // Buffers the phases share (written by a split phase, read by all after a barrier): q|k|v, roped q, attention,
  // o, gate|up, down.
  const int64_t qkv_n = (H + 2 * KVH) * D;
  std::vector<float> shared(B * (qkv_n + 2 * H * D + hidden + max_gu + hidden));
  float* qkv_y = shared.data();
  float* q = qkv_y + B * qkv_n;
  float* att = q + B * H * D;
  float* o_y = att + B * H * D;
  float* gu = o_y + B * hidden;
  float* dn = gu + B * max_gu;
  const RowBuffers::Sizes sizes{B, hidden, max_k, max_groups, max_gu};
  RowBuffers common(sizes);
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const float *cp = cos_c.data_ptr<float>(), *sp = sin_c.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const float eps = static_cast<float>(eps_d), sc = static_cast<float>(scale);
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), 64)));

  // Every layer, run by each of the nt threads of a team; `sync` is the barrier between dependent phases.
  auto body = [&](int tid, int nt, auto&& sync) {
    Scratch w;
    int64_t a, b;
    // With few rows every thread does the row-wise work (norms, residual adds, SwiGLU, the INT4 inputs' prep)
    // of every row itself, into buffers of its own: the same loops on the same inputs, so the same bits, and
    // no barrier between a row phase and the linear that reads it (at batch 1 the row phases had one thread
    // working and the rest waiting at 4 of a layer's 8 barriers).
    const bool own = nt > 1 && B <= kOwnRowsMax;
    std::optional<RowBuffers> mine;
    if (own) mine.emplace(sizes);
    RowBuffers& rb = own ? *mine : common;
    auto rows = [&](int64_t& r0, int64_t& r1) {
      if (own) r0 = 0, r1 = B;
      else share(B, tid, nt, r0, r1);
    };
    auto row_sync = [&] {
      if (!own) sync();
    };
    for (int64_t l = 0; l < n; ++l) {
      const Layer& L = plan[l];
      const float* hin = l == 0 ? h.data_ptr<float>() : rb.stream[(l - 1) % 2];
      // the last layer's output: one thread's copy when each has its own
      float* hout = l == n - 1 && (!own || tid == 0) ? outp : rb.stream[l % 2];
      const int64_t gu_n = L.gate_up.N, I = gu_n / 2;
      rows(a, b);  // the rows this thread also finished in the previous layer: no barrier before
      for (int64_t r = a; r < b; ++r) {
        rms_norm_row(hin + r * hidden, L.norm1, rb.xn + r * hidden, hidden, eps);
        L.qkv.prepare_row(rb.xn, r, rb.prep);
      }
      row_sync();
      share(L.qkv.units(), tid, nt, a, b);
      L.qkv.run(rb.xn, B, qkv_y, a, b, rb.prep);
      sync();
      share(B * KVH, tid, nt, a, b);
      for (int64_t task = a; task < b; ++task) {
        rope_and_write(qkv_y, cp, sp, q, task / KVH, task % KVH, H, L.kv, pos);
        attend_task(task, q, att, H, L.kv, pos, sc, w);
      }
      sync();
      if (L.o.prepares()) {
        rows(a, b);
        for (int64_t r = a; r < b; ++r) L.o.prepare_row(att, r, rb.prep);
        row_sync();
      }
      share(L.o.units(), tid, nt, a, b);
      L.o.run(att, B, o_y, a, b, rb.prep);
      sync();
      rows(a, b);
      for (int64_t r = a; r < b; ++r) {
        add_row(hin + r * hidden, o_y + r * hidden, rb.h2 + r * hidden, hidden);
        rms_norm_row(rb.h2 + r * hidden, L.norm2, rb.x2 + r * hidden, hidden, eps);
        L.gate_up.prepare_row(rb.x2, r, rb.prep);
      }
      row_sync();
      share(L.gate_up.units(), tid, nt, a, b);
      L.gate_up.run(rb.x2, B, gu, a, b, rb.prep);
      sync();
      rows(a, b);
      for (int64_t r = a; r < b; ++r) {
        silu_mul_row(gu + r * gu_n, rb.act + r * I, I);
        L.down.prepare_row(rb.act, r, rb.prep);
      }
      row_sync();
      share(L.down.units(), tid, nt, a, b);
      L.down.run(rb.act, B, dn, a, b, rb.prep);
      sync();
      rows(a, b);
      for (int64_t r = a; r < b; ++r) add_row(rb.h2 + r * hidden, dn + r * hidden, hout + r * hidden, hidden);
    }
  };
  if (threads == 1) {
    body(0, 1, [] {});
  } else {
#pragma omp parallel num_threads(threads)
    body(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("decode_layers(Tensor h, Tensor[] weights, int[] meta, int[] layers, Tensor cos, Tensor sin, "
        "Tensor(a!)[] segments, Tensor segment_of, Tensor slot_of, Tensor lens, float scale, int num_heads, "
        "float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("decode_layers", decode_layers); }
