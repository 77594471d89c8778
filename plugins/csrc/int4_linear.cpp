// INT4 weight-only linear on AVX2 CPUs with fp32 activations: y[M, N] = x[M, K] @ W[N, K]^T, where
// W = q * s + (z - 8 s) per group of G inputs (the portable fragment format of plugins/quant_matmul.py:
// nibbles [N, K/2], element 2i in the high nibble; scale s and zero z in bf16).
//
// Why this shape: decode reads every weight once per step, so the nibbles must be unpacked with as few
// instructions as reading them costs. The first version (weights unpacked to fp32 and dequantized in
// registers, one output per accumulator) spent ~12 vector instructions per 16 weights and read its nibbles at
// 5 GB/s on one core, no faster than the fp16 weights it replaced.
// - Platform packing (`int4_pack`, once at load): blocks of 8 weight rows, one row per AVX2 lane. A 32-byte
//   load holds 8 consecutive inputs of each of the 8 rows (input k = 8c + j in bits 4j..4j+3 of row r's
//   32-bit word), so one shift and one mask give the next input of all 8 rows: no shuffles, no permuted x,
//   and the 8 outputs come out as one vector (no horizontal sums). Scales and zeros are regrouped the same way
//   (still bf16, the same bytes).
// - Scaling per group, not per weight: y = sum_g s_g * (x_g . q_g) + (z_g - 8 s_g) * sum(x_g). The inner loop
//   is one mask, one int->float convert and one FMA per 8 weights and row of x (nibble_in_place).
// - Four row blocks per tile: four independent FMA chains at batch 1.
// - Up to two rows of x the nibbles are unpacked in registers; more rows (up to `max_skinny_rows`) unpack
//   each group of the tile once into an L1 buffer that every row then reads. Both sum in the same order, so a
//   row's result does not depend on the batch. Prefill chunks (more rows) dequantize to a transient fp32
//   matrix and run MKL.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;      // weight rows per block, one per AVX2 lane
constexpr int64_t kTileBlocks = 4;  // row blocks per tile: independent accumulators at batch 1
constexpr int64_t kRegRows = 2;     // rows of x up to which the nibbles are unpacked in registers
constexpr int64_t kBufRows = 3;     // rows of x per pass over the unpacked buffer (12 accumulators + 4 of 16 registers; 3 beat 2 by 1.1-1.3x)
constexpr int64_t kMaxRows = 64;    // skinny limit accepted (the per-tile accumulators live on the stack)

// The packed weight: tiles of kTileBlocks blocks (the last may have fewer), stored one after the other; in a
// tile, chunk c (inputs 8c..8c+7) of its blocks side by side, so a tile is one contiguous stream of memory and
// consecutive tiles continue it (separate short streams per block left the hardware prefetcher behind: the
// nibbles streamed from memory at 9 GB/s on one core against 14 GB/s from L2). Word r of block b's chunk c
// holds row 8b + r's inputs 8c + j at bits 4j. Scales and zeros: affine[((b * groups + g) * 2 + t) * 8 + r],
// t = 0 scale, 1 zero.
struct Packed {
  const uint32_t* q;
  const uint16_t* affine;
  int64_t K, G, groups, blocks;
  const uint32_t* word(int64_t b, int64_t c) const {
    const int64_t t = b / kTileBlocks, nb = std::min(kTileBlocks, blocks - t * kTileBlocks);
    return q + t * kTileBlocks * (K / 8) * kLanes + (c * nb + b % kTileBlocks) * kLanes;
  }
  const uint16_t* block_affine(int64_t b, int64_t g) const { return affine + (b * groups + g) * 2 * kLanes; }
};

inline __m256 bf16x8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Input j of the 8 rows in `v`, as floats 0..15.
template <int J>
inline __m256 nibble(__m256i v) {
  __m256i t = J == 0 ? v : _mm256_srli_epi32(v, 4 * J);
  if (J < 7) t = _mm256_and_si256(t, _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(t);
}

// The same input masked in place, without the shift: q * 16^j, exact in fp32 (4 significant bits). The hot
// loops multiply it with x pre-scaled by 16^-j (exact too), so each product equals x * q bit for bit with one
// instruction less per 8 weights. Input 7 is shifted: masked in place it would be a negative int32.
template <int J>
inline __m256 nibble_in_place(__m256i v) {
  if (J == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * J))));
}

// x[k] * 16^-(k % 8) (k % 8 < 7), x[k] otherwise: the partner of nibble_in_place.
void prescale(const float* x, float* out, int64_t n) {
  static constexpr float kScale[8] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096, 1.f / 65536, 1.f / 1048576,
                                      1.f / 16777216, 1.f};
  for (int64_t k = 0; k < n; ++k) out[k] = x[k] * kScale[k % 8];
}

// part[m][b] += x[m, k..k+8) . q[block b][k..k+8), for one 8-input chunk, q from registers.
template <int MT, int NB>
inline void chunk_regs(const float* x, int64_t ldx, const __m256i* v, __m256 (&part)[MT][NB]) {
#define MS_STEP(J)                                                                    \
  {                                                                                   \
    __m256 xb[MT];                                                                    \
    for (int m = 0; m < MT; ++m) xb[m] = _mm256_broadcast_ss(x + m * ldx + J);        \
    for (int b = 0; b < NB; ++b) {                                                    \
      const __m256 qf = nibble_in_place<J>(v[b]);                                     \
      for (int m = 0; m < MT; ++m) part[m][b] = _mm256_fmadd_ps(xb[m], qf, part[m][b]); \
    }                                                                                 \
  }
  MS_STEP(0) MS_STEP(1) MS_STEP(2) MS_STEP(3) MS_STEP(4) MS_STEP(5) MS_STEP(6) MS_STEP(7)
#undef MS_STEP
}

// The group's scaling into the running totals: tot += part * s + sum(x_g) * (z - 8 s).
template <int MT, int NB>
inline void finish_group(const Packed& p, int64_t b0, int64_t g, const float* xsum, int64_t groups,
                         __m256 (&part)[MT][NB], float* tot, int64_t ldt) {
  for (int b = 0; b < NB; ++b) {
    const uint16_t* a = p.block_affine(b0 + b, g);
    const __m256 s = bf16x8(a), z = bf16x8(a + kLanes);
    const __m256 c = _mm256_sub_ps(z, _mm256_mul_ps(_mm256_set1_ps(8.f), s));
    for (int m = 0; m < MT; ++m) {
      float* t = tot + m * ldt + b * kLanes;
      __m256 acc = _mm256_fmadd_ps(part[m][b], s, _mm256_loadu_ps(t));
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xsum + m * groups + g), c, acc);
      _mm256_storeu_ps(t, acc);
    }
  }
}

// MT rows of x against NB blocks, group g, nibbles unpacked in registers.
template <int MT, int NB>
inline void group_regs(const Packed& p, int64_t b0, int64_t g, const float* x, int64_t ldx, const float* xsum,
                       float* tot, int64_t ldt) {
  __m256 part[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) part[m][b] = _mm256_setzero_ps();
  for (int64_t k = g * p.G; k < (g + 1) * p.G; k += 8) {
    __m256i v[NB];
    for (int b = 0; b < NB; ++b)
      v[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.word(b0 + b, k / 8)));
    chunk_regs<MT, NB>(x + k, ldx, v, part);
  }
  finish_group<MT, NB>(p, b0, g, xsum, p.groups, part, tot, ldt);
}

// Group g of NB blocks unpacked to floats: buf[(kk * NB + b) * 8 + r] = q of row r of block b at input g*G+kk.
template <int NB>
inline void unpack_group(const Packed& p, int64_t b0, int64_t g, float* buf) {
  for (int64_t kk = 0; kk < p.G; kk += 8)
    for (int b = 0; b < NB; ++b) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.word(b0 + b, (g * p.G + kk) / 8)));
      float* o = buf + (kk * NB + b) * kLanes;
      _mm256_storeu_ps(o + 0 * NB * kLanes, nibble_in_place<0>(v));
      _mm256_storeu_ps(o + 1 * NB * kLanes, nibble_in_place<1>(v));
      _mm256_storeu_ps(o + 2 * NB * kLanes, nibble_in_place<2>(v));
      _mm256_storeu_ps(o + 3 * NB * kLanes, nibble_in_place<3>(v));
      _mm256_storeu_ps(o + 4 * NB * kLanes, nibble_in_place<4>(v));
      _mm256_storeu_ps(o + 5 * NB * kLanes, nibble_in_place<5>(v));
      _mm256_storeu_ps(o + 6 * NB * kLanes, nibble_in_place<6>(v));
      _mm256_storeu_ps(o + 7 * NB * kLanes, nibble_in_place<7>(v));
    }
}

// MT rows of x against NB blocks, group g, from the unpacked buffer: the same FMAs in the same order as
// group_regs, so the results are bitwise equal.
template <int MT, int NB>
inline void group_buf(const Packed& p, int64_t b0, int64_t g, const float* buf, const float* x, int64_t ldx,
                      const float* xsum, float* tot, int64_t ldt) {
  __m256 part[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) part[m][b] = _mm256_setzero_ps();
  const float* xg = x + g * p.G;
  for (int64_t kk = 0; kk < p.G; ++kk) {
    __m256 xb[MT];
    for (int m = 0; m < MT; ++m) xb[m] = _mm256_broadcast_ss(xg + m * ldx + kk);
    for (int b = 0; b < NB; ++b) {
      const __m256 qf = _mm256_loadu_ps(buf + (kk * NB + b) * kLanes);
      for (int m = 0; m < MT; ++m) part[m][b] = _mm256_fmadd_ps(xb[m], qf, part[m][b]);
    }
  }
  finish_group<MT, NB>(p, b0, g, xsum, p.groups, part, tot, ldt);
}

// All M rows of x against the NB blocks starting at b0; y columns n0 = b0 * 8 .. (the valid ones of N).
template <int NB>
void tile(const Packed& p, int64_t b0, const float* x, int64_t M, const float* xsum, float* y, int64_t N,
          std::vector<float>& buf) {
  constexpr int64_t ldt = NB * kLanes;
  alignas(32) float tot[kMaxRows * ldt];
  std::memset(tot, 0, sizeof(float) * M * ldt);
  const int64_t K = p.K;
  for (int64_t g = 0; g < p.groups; ++g) {
    if (M <= kRegRows) {
      if (M == 2) group_regs<2, NB>(p, b0, g, x, K, xsum, tot, ldt);
      else group_regs<1, NB>(p, b0, g, x, K, xsum, tot, ldt);
      continue;
    }
    unpack_group<NB>(p, b0, g, buf.data());
    int64_t m = 0;
    for (; m + kBufRows <= M; m += kBufRows)
      group_buf<kBufRows, NB>(p, b0, g, buf.data(), x + m * K, K, xsum + m * p.groups, tot + m * ldt, ldt);
    for (; m < M; ++m) group_buf<1, NB>(p, b0, g, buf.data(), x + m * K, K, xsum + m * p.groups, tot + m * ldt, ldt);
  }
  const int64_t n0 = b0 * kLanes, nt = std::min<int64_t>(ldt, N - n0);
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, tot + m * ldt, sizeof(float) * nt);
}

void check_portable(const at::Tensor& qweight, const at::Tensor& sz, int64_t G) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "int4_pack: contiguous uint8 qweight [N, K/2] expected");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(G > 0 && G % 8 == 0 && K % G == 0, "int4: group size ", G, " must be a multiple of 8 that divides K = ", K);
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 && sz.size(0) == N &&
                  sz.size(1) == K / G && sz.size(2) == 2,
              "int4_pack: contiguous bf16 scales_zeros [N, K/G, 2] = [", N, ", ", K / G, ", 2] expected");
}

Packed check_packed(const at::Tensor& packed, const at::Tensor& affine, int64_t N, int64_t G) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kLanes * 4 &&
                  packed.is_contiguous(),
              "int4_linear: packed weight [N/8, K/8, 32] uint8 from int4_pack expected");
  const int64_t blocks = packed.size(0), K = packed.size(1) * 8;
  TORCH_CHECK(N > (blocks - 1) * kLanes && N <= blocks * kLanes, "int4_linear: ", N, " output features do not fit ",
              blocks, " packed blocks of 8 rows");
  TORCH_CHECK(G > 0 && G % 8 == 0 && K % G == 0, "int4: group size ", G, " must be a multiple of 8 that divides K = ", K);
  TORCH_CHECK(affine.scalar_type() == at::kBFloat16 && affine.is_contiguous() && affine.dim() == 4 &&
                  affine.size(0) == blocks && affine.size(1) == K / G && affine.size(2) == 2 && affine.size(3) == kLanes,
              "int4_linear: bf16 scales/zeros [N/8, K/G, 2, 8] = [", blocks, ", ", K / G, ", 2, 8] from int4_pack expected");
  return Packed{reinterpret_cast<const uint32_t*>(packed.data_ptr<uint8_t>()),
                reinterpret_cast<const uint16_t*>(affine.data_ptr<at::BFloat16>()), K, G, K / G, blocks};
}

// Portable nibbles and [N, K/G, 2] scales/zeros -> the kernel's blocks (rows past N are zero).
std::tuple<at::Tensor, at::Tensor> int4_pack(const at::Tensor& qweight, const at::Tensor& sz, int64_t G) {
  check_portable(qweight, sz, G);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, groups = K / G, blocks = (N + kLanes - 1) / kLanes;
  at::Tensor packed = at::zeros({blocks, K / 8, kLanes * 4}, at::kByte);
  at::Tensor affine = at::zeros({blocks, groups, 2, kLanes}, at::kBFloat16);
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint32_t* pq = reinterpret_cast<uint32_t*>(packed.data_ptr<uint8_t>());
  const Packed layout{pq, nullptr, K, G, groups, blocks};
  uint16_t* pa = reinterpret_cast<uint16_t*>(affine.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / kLanes, r = n % kLanes;
    for (int64_t c = 0; c < K / 8; ++c) {
      uint32_t word = 0;
      for (int j = 0; j < 8; ++j) {
        const int64_t k = c * 8 + j;
        const uint8_t byte = q[n * (K / 2) + k / 2];
        word |= static_cast<uint32_t>(k % 2 == 0 ? byte >> 4 : byte & 0xF) << (4 * j);
      }
      const_cast<uint32_t*>(layout.word(b, c))[r] = word;
    }
    for (int64_t g = 0; g < groups; ++g)
      for (int t = 0; t < 2; ++t) pa[((b * groups + g) * 2 + t) * kLanes + r] = s[(n * groups + g) * 2 + t];
  }
  return {packed, affine};
}

// The fp32 weight [N, K] (w = q * s + (z - 8 s)) into `out`: the prefill path's and the tests' reference.
void dequantize_into(const Packed& p, int64_t N, float* out) {
  const int64_t blocks = (N + kLanes - 1) / kLanes, K = p.K;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(32) float w[8 * kLanes];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(kLanes, N - b * kLanes);
      for (int64_t c = 0; c < K / 8; ++c) {
        const uint16_t* a = p.block_affine(b, c * 8 / p.G);
        const __m256 s = bf16x8(a), z = bf16x8(a + kLanes);
        const __m256 off = _mm256_sub_ps(z, _mm256_mul_ps(_mm256_set1_ps(8.f), s));
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.word(b, c)));
        _mm256_store_ps(w + 0 * kLanes, _mm256_fmadd_ps(nibble<0>(v), s, off));
        _mm256_store_ps(w + 1 * kLanes, _mm256_fmadd_ps(nibble<1>(v), s, off));
        _mm256_store_ps(w + 2 * kLanes, _mm256_fmadd_ps(nibble<2>(v), s, off));
        _mm256_store_ps(w + 3 * kLanes, _mm256_fmadd_ps(nibble<3>(v), s, off));
        _mm256_store_ps(w + 4 * kLanes, _mm256_fmadd_ps(nibble<4>(v), s, off));
        _mm256_store_ps(w + 5 * kLanes, _mm256_fmadd_ps(nibble<5>(v), s, off));
        _mm256_store_ps(w + 6 * kLanes, _mm256_fmadd_ps(nibble<6>(v), s, off));
        _mm256_store_ps(w + 7 * kLanes, _mm256_fmadd_ps(nibble<7>(v), s, off));
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < 8; ++j) out[(b * kLanes + r) * K + c * 8 + j] = w[j * kLanes + r];
      }
    }
  });
}

at::Tensor int4_dequantize(const at::Tensor& packed, const at::Tensor& affine, int64_t N, int64_t G) {
  const Packed p = check_packed(packed, affine, N, G);
  at::Tensor w = at::empty({N, p.K}, at::kFloat);
  dequantize_into(p, N, w.data_ptr<float>());
  return w;
}

// Prefill-sized input: dequantize into a per-thread scratch (kept: a fresh multi-MB tensor per call would be
// mapped and faulted in anew each time) and let MKL multiply.
at::Tensor dequantized_linear(const at::Tensor& input, const Packed& p, int64_t N) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < N * p.K) scratch.resize(N * p.K);
  dequantize_into(p, N, scratch.data());
  return at::linear(input, at::from_blob(scratch.data(), {N, p.K}, at::kFloat));
}

// `pre_scale` [K] (AWQ's activation scale of o/down, or none): x * pre_scale is what the weight multiplies;
// applied here rather than as a torch op before the call (one dispatch less per layer and linear).
at::Tensor int4_linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& affine,
                       const std::optional<at::Tensor>& pre_scale, int64_t N, int64_t G, int64_t max_skinny_rows) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2 && input.device().is_cpu(),
              "int4_linear: fp32 CPU input [M, K] expected");
  TORCH_CHECK(max_skinny_rows >= 0 && max_skinny_rows <= kMaxRows, "int4_linear: max_skinny_rows ",
              max_skinny_rows, " outside 0..", kMaxRows);
  const Packed p = check_packed(packed, affine, N, G);
  const int64_t M = input.size(0), K = input.size(1);
  TORCH_CHECK(K == p.K, "int4_linear: input has ", K, " features, weight expects ", p.K);
  const bool scaled = pre_scale.has_value() && pre_scale->defined();
  if (scaled)
    TORCH_CHECK(pre_scale->scalar_type() == at::kFloat && pre_scale->dim() == 1 && pre_scale->size(0) == K &&
                    pre_scale->is_contiguous(),
                "int4_linear: contiguous fp32 pre_scale [", K, "] expected");
  if (M > max_skinny_rows) return dequantized_linear(scaled ? input * *pre_scale : input, p, N);
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty({M, N}, at::kFloat);
  if (M == 0 || N == 0) return y;
  // x * pre_scale (the same fp32 products torch's multiply gives), then per row and group sum(x_g) in a fixed
  // order (the zero-point term), then x pre-scaled for nibble_in_place.
  std::vector<float> xw, xsum(M * p.groups), xs(M * K);
  const float* xr = x.data_ptr<float>();
  if (scaled) {
    const float* ps = pre_scale->data_ptr<float>();
    xw.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) xw[i] = xr[i] * ps[i % K];
    xr = xw.data();
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < p.groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) s += xr[m * K + k];
      xsum[m * p.groups + g] = s;
    }
  prescale(xr, xs.data(), M * K);
  const float* xp = xs.data();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = packed.size(0), tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buf;
    if (M > kRegRows && static_cast<int64_t>(buf.size()) < kTileBlocks * G * kLanes) buf.resize(kTileBlocks * G * kLanes);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * kTileBlocks, nb = std::min(kTileBlocks, blocks - b0);
      if (nb == kTileBlocks) {
        tile<kTileBlocks>(p, b0, xp, M, xsum.data(), yp, N, buf);
      } else {
        for (int64_t b = b0; b < b0 + nb; ++b) tile<1>(p, b, xp, M, xsum.data(), yp, N, buf);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_pack(Tensor qweight, Tensor scales_zeros, int group_size) -> (Tensor, Tensor)");
  m.def("int4_linear(Tensor input, Tensor packed, Tensor affine, Tensor? pre_scale, int out_features, int group_size, int max_skinny_rows) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor affine, int out_features, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("int4_pack", int4_pack);
  m.impl("int4_linear", int4_linear);
  m.impl("int4_dequantize", int4_dequantize);
}
