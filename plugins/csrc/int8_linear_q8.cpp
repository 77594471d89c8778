// The INT8 table's linear with int8 activations (W8A8) on AVX-512 VNNI CPUs: y[M, N] = s[n] * sum over blocks
// b of d[m, b] * (xq[m, b] . q[n, b]), x quantized per kQBlock inputs (absmax / 127, rounded to nearest even),
// q the table's int8 rows with one fp32 scale each (plugins/int8_linear.py). It serves the LM head when that
// unit is morphed to INT8.
//
// Why: with fp32 activations (int8_linear.cpp) each 8 weights cost a widen, a convert and an FMA per row, and
// at 16 decode rows the 49152 x 576 head was compute-bound at ~6.5 ms a step on this 2-core machine, a fifth
// of the step. `vpdpbusd` multiplies 64 unsigned by 64 signed bytes and adds them in fours into 16 int32 lanes
// in one instruction, exactly.
//
// Layout (`int8_pack_q8`, once at load; the table then keeps only this form): 16 weight rows interleaved per 4
// inputs, so one zmm holds the same 4 inputs of 16 rows and each `vpdpbusd` lane is one output row: a block of
// 64 inputs is 16 `vpdpbusd` into one accumulator per row of x, then one convert and one FMA with the block's
// d. (Row-major weights, the first version, put one output row in each zmm; every `vpdpbusd` then needed its
// own convert and FMA, 3 instructions per 64 products, and the head ran at a third of `vpdpbusd`'s rate.) The
// bytes are stored with their sign bit flipped (w + 128, unsigned), and each block's accumulator starts at
// -128 x the block's input sum: every block's integer dot product is exact, converted to fp32 exactly
// (|sum| <= 64 * 127 * 127 < 2^24), and the blocks are summed in increasing order, one FMA each.
//
// The same arithmetic whatever the batch (each row alone, blocks in order): a row's result does not depend on
// its batch. Against the torch reference (reference_linear_q8) the integer sums are identical and only the fp32
// order of the block sums differs (a few ulp).
//
// Compiled for AVX-512 through function target attributes (the rest of the library stays AVX2); the op
// refuses to run where the CPU lacks the instructions (checked at run time), and Python only calls it where
// /proc/cpuinfo lists them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"

namespace {

using morphserve_cpu::cpu_has_avx512_vnni;

constexpr int64_t kQBlock = 64;   // inputs per activation scale: one zmm of bytes (+0.10% perplexity, per row +0.75%)
constexpr int64_t kCols = 16;     // weight rows per packed block: one per int32 lane of a zmm
constexpr int64_t kRowTile = 8;   // rows of x per pass over a packed block (8 accumulators and 8 sums of 32 registers)

// Row x [K] to int8 blocks: q [K], d [K / kQBlock], and each block's accumulator start -128 * (sum of its
// inputs) into init [K / kQBlock]. Scalar on purpose: the same float ops as the torch reference (a / 127,
// 127 / a, round half to even), so both quantize bit for bit alike; M x K is small.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* init) {
  for (int64_t b = 0; b < K / kQBlock; ++b) {
    const float* xb = x + b * kQBlock;
    float a = 0.f;
    // A NaN input makes the scale NaN (as torch's amax does) and so the row's outputs; its bytes are then 0.
    for (int64_t k = 0; k < kQBlock; ++k) a = std::isnan(xb[k]) || std::fabs(xb[k]) > a ? std::fabs(xb[k]) : a;
    d[b] = a / 127.f;
    const float inv = a > 0.f ? 127.f / a : 0.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < kQBlock; ++k) {
      const float v = xb[k] * inv;
      q[b * kQBlock + k] = v == v ? static_cast<int8_t>(std::nearbyint(v)) : 0;
      sum += q[b * kQBlock + k];
    }
    init[b] = -128 * sum;
  }
}

struct Quantized {
  const int8_t* q;
  const float* d;
  const int32_t* init;
  int64_t K;
};

// MT rows of x (from row m0) against one packed block of 16 weight rows (`w`: [K/4][16][4] bytes, w + 128);
// y[m * ldy + j] for the block's `nvalid` rows j, each times its scale.
template <int MT>
MS_AVX512_VNNI inline void tile(const Quantized& x, int64_t m0, const uint8_t* w, int64_t nvalid, const float* scale,
                                float* y, int64_t ldy) {
  const int64_t K = x.K, blocks = K / kQBlock;
  __m512 part[MT];
  for (int m = 0; m < MT; ++m) part[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_set1_epi32(x.init[(m0 + m) * blocks + b]);
    const uint8_t* wb = w + b * kQBlock * kCols;
    // Unrolled: a rolled loop made GCC shuffle the accumulators through extra registers and the stack.
#pragma GCC unroll 16
    for (int c = 0; c < kQBlock / 4; ++c) {
      const __m512i wv = _mm512_loadu_si512(wb + c * 4 * kCols);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        int32_t four;
        std::memcpy(&four, x.q + (m0 + m) * K + b * kQBlock + c * 4, 4);
        acc[m] = _mm512_dpbusd_epi32(acc[m], wv, _mm512_set1_epi32(four));
      }
    }
    for (int m = 0; m < MT; ++m)
      part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(x.d[(m0 + m) * blocks + b]), part[m]);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << nvalid) - 1u);
  const __m512 sv = _mm512_maskz_loadu_ps(valid, scale);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy, valid, _mm512_mul_ps(part[m], sv));
}

// All M rows against one packed block: passes of 8 rows, then of 4, 2 and 1.
MS_AVX512_VNNI void rows_times_block(const Quantized& x, int64_t M, const uint8_t* w, int64_t nvalid,
                                     const float* scale, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + kRowTile <= M; m += kRowTile) tile<kRowTile>(x, m, w, nvalid, scale, y, ldy);
  if (M - m >= 4) tile<4>(x, m, w, nvalid, scale, y, ldy), m += 4;
  if (M - m >= 2) tile<2>(x, m, w, nvalid, scale, y, ldy), m += 2;
  if (M - m >= 1) tile<1>(x, m, w, nvalid, scale, y, ldy);
}

// int8 weight [N, K] -> the kernel's layout: uint8 [ceil(N / 16), K / 4, 16, 4], byte (n, k) of row n =
// 16 p + j at [p][k / 4][j][k % 4], as w + 128; rows past N hold 128 (weight 0).
at::Tensor int8_pack_q8(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.device().is_cpu(),
              "int8_pack_q8: int8 CPU weight [N, K] expected, got ", weight.scalar_type(), " with ", weight.dim(), " dims");
  TORCH_CHECK(weight.size(1) % kQBlock == 0, "int8_pack_q8: the feature count ", weight.size(1),
              " must be a multiple of ", kQBlock);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kCols - 1) / kCols;
  at::Tensor packed = at::full({NB, K / 4, kCols, 4}, 128, at::kByte);
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, NB, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j) {
        const int8_t* row = src + (p * kCols + j) * K;
        for (int64_t k = 0; k < K; ++k)
          dst[((p * (K / 4) + k / 4) * kCols + j) * 4 + k % 4] = static_cast<uint8_t>(row[k] ^ static_cast<int8_t>(0x80));
      }
  });
  return packed;
}

at::Tensor int8_linear_q8(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "int8_linear_q8: this CPU lacks AVX-512 VNNI (use int8_linear, fp32 activations)");
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() == 2 && input.device().is_cpu(),
              "int8_linear_q8: 2-D fp32 CPU input [M, K] expected, got ", input.scalar_type(), " with ", input.dim(), " dims");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 4 &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "int8_linear_q8: packed weight [N/16, K/4, 16, 4] uint8 from int8_pack_q8 expected");
  const int64_t K = packed.size(1) * 4, NB = packed.size(0);
  TORCH_CHECK(input.size(1) == K, "int8_linear_q8: input has ", input.size(1), " features, weight expects ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.is_contiguous() &&
                  scales.size(0) > (NB - 1) * kCols && scales.size(0) <= NB * kCols,
              "int8_linear_q8: contiguous fp32 scales of the table's ", (NB - 1) * kCols + 1, "..", NB * kCols,
              " rows expected, got ", scales.sizes());
  const at::Tensor xin = input.contiguous();
  const int64_t M = xin.size(0), N = scales.size(0), blocks = K / kQBlock;
  at::Tensor y = at::empty({M, N}, xin.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * blocks);
  std::vector<int32_t> init(M * blocks);
  const float* xp = xin.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, q.data() + m * K, d.data() + m * blocks, init.data() + m * blocks);
  const Quantized x{q.data(), d.data(), init.data(), K};
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / (kCols * K));
  at::parallel_for(0, NB, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * kCols;
      rows_times_block(x, M, wp + n * K, std::min<int64_t>(kCols, N - n), sp + n, yp + n, N);
    }
  });
  return y;
}

bool int8_linear_q8_supported() { return cpu_has_avx512_vnni(); }

// The table's rows `ids` (any shape) dequantized from the packed layout -> fp32 [*ids.shape, K]: the embedding
// lookup of a decode step in one call (the torch twin in int8_linear.py, gather + widen + scale, is ~10 ops, each
// paying a cold dispatch right after a forward). Each value is (byte - 128) * scale, as there: bitwise the same.
at::Tensor int8_lookup_q8(const at::Tensor& ids, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(), "int8_lookup_q8: int64 CPU ids expected, got ",
              ids.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 4 &&
                  packed.is_contiguous(),
              "int8_lookup_q8: a contiguous uint8 packed table [blocks, K/4, ", kCols, ", 4] expected, got ", packed.sizes());
  const int64_t NB = packed.size(0), K4 = packed.size(1), K = K4 * 4;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.is_contiguous() &&
                  scales.size(0) <= NB * kCols,
              "int8_lookup_q8: contiguous fp32 scales of at most ", NB * kCols, " rows expected, got ", scales.sizes());
  const int64_t N = scales.size(0);
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* ip = flat.data_ptr<int64_t>();
  const int64_t R = flat.numel();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "int8_lookup_q8: id ", ip[r], " is outside the table's ", N, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, scales.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t id = ip[r], block = id / kCols, lane = id % kCols;
    const uint8_t* src = wp + (block * K4 * kCols + lane) * 4;  // input k of the row: src[(k / 4) * kCols * 4 + k % 4]
    const float scale = sp[id];
    float* dst = op + r * K;
    for (int64_t k4 = 0; k4 < K4; ++k4)
      for (int c = 0; c < 4; ++c)
        dst[k4 * 4 + c] = static_cast<float>(static_cast<int32_t>(src[k4 * kCols * 4 + c]) - 128) * scale;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int8_pack_q8(Tensor weight) -> Tensor");
  m.def("int8_linear_q8(Tensor input, Tensor packed, Tensor scales) -> Tensor");
  m.def("int8_linear_q8_supported() -> bool", int8_linear_q8_supported);  // no tensors: a catch-all kernel
  m.def("int8_lookup_q8(Tensor ids, Tensor packed, Tensor scales) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("int8_pack_q8", int8_pack_q8);
  m.impl("int8_linear_q8", int8_linear_q8);
  m.impl("int8_lookup_q8", int8_lookup_q8);
}
