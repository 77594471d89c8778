// INT8 weight-only linear on AVX2 CPUs with fp32 activations: y[M, N] = s[n] * (x[M, K] . q[N, K]), q int8 with
// one fp32 scale per weight row (symmetric). It serves the shared embedding / LM head table when that unit is
// morphed to INT8 (plugins/int8_linear.py): SmolLM2's table is 49152 x 576, 57 MB in fp16, 28 MB in int8, and a
// decode step reads all of it for the sampled rows.
//
// Why this shape: decode is bound by reading the weights, so each block of kBlock weight rows is read once from
// memory (prefetched ahead) and reused from L1 for every row of x. int8 widens to fp32 exactly (vpmovsxbd +
// vcvtdq2ps, the load folded in), so the arithmetic is plain fp32: each dot product sums 8 lanes at a time in
// increasing k, adds the lanes, finishes the K % 8 tail with fma and multiplies by the row's scale last. That
// order is the same whatever the tile shape: a row's result does not depend on its batch.
// The int8 is widened in registers again for every pair of rows of x: on the 2-core AVX2 machine that beat
// widening each block once into an L1 buffer read by all rows (one thread, the 49152 x 576 head: batch 4
// 2.3 against 4.4 ms, batch 8 4.5 against 8.5, batch 32 18.0 against 21.1).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_tile.h"
#include "int8_checks.h"

namespace {

constexpr int64_t kBlock = 8;    // weight rows read together (8 accumulators at batch 1: the FMA latency hidden)
// The rows kPrefetchBlocks blocks ahead are prefetched a cache line per row as the tile passes the same offset
// (cpu_tile.h's block_ahead, into L2). Without it the block's 8 short row streams ran at ~10 GB/s from memory on
// one core (the same loop ran 3x faster with the table in L2): the hardware prefetcher kept too few lines in
// flight.

// One MT x NT tile through the shared fp32 tile (cpu_tile.h: the summation order that keeps a row's result
// independent of its batch), then each output times its weight row's scale.
template <int MT, int NT, typename W>
inline void tile(const float* x, int64_t K, const W* w, int64_t ldw, const float* scale, float* y, int64_t ldy,
                 const W* ahead = nullptr) {
  morphserve_cpu::tile<MT, NT>(x, K, w, ldw, y, ldy, K, ahead);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) y[m * ldy + n] *= scale[n];
}

// All M rows of x against nt (<= kBlock) weight rows; `ahead`: a full block to prefetch, or null.
template <typename W>
void rows_times_block(const float* x, int64_t M, int64_t K, const W* w, int64_t nt, const float* scale, float* y,
                      int64_t ldy, const W* ahead = nullptr) {
  if (M == 1 && nt == kBlock) {
    tile<1, kBlock>(x, K, w, K, scale, y, ldy, ahead);
    return;
  }
  int64_t n = 0;
  for (; n + 4 <= nt; n += 4) {
    int64_t m = 0;
    const W* pre = ahead == nullptr ? nullptr : ahead + n * K;  // the first row tile prefetches, the others hit L1
    for (; m + 2 <= M; m += 2, pre = nullptr) tile<2, 4>(x + m * K, K, w + n * K, K, scale + n, y + m * ldy + n, ldy, pre);
    if (m < M) tile<1, 4>(x + m * K, K, w + n * K, K, scale + n, y + m * ldy + n, ldy);
  }
  for (; n < nt; ++n) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) tile<2, 1>(x + m * K, K, w + n * K, K, scale + n, y + m * ldy + n, ldy);
    if (m < M) tile<1, 1>(x + m * K, K, w + n * K, K, scale + n, y + m * ldy + n, ldy);
  }
}

at::Tensor int8_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales) {
  morphserve_cpu::check_int8_linear_args("int8_linear", input, weight, scales);
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  // Grain: at least ~16K weights per task so that thread hand-off stays negligible.
  const int64_t grain = std::max<int64_t>(1, (16384 + kBlock * K - 1) / (kBlock * K));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t full = std::min(b1, N / kBlock);  // blocks of kBlock rows that exist
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kBlock, nt = std::min<int64_t>(kBlock, N - n);
      const int8_t* ahead = morphserve_cpu::block_ahead(wp, b, full, K, kBlock);
      rows_times_block(xp, M, K, wp + n * K, nt, sp + n, yp + n, N, ahead);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) { m.def("int8_linear(Tensor input, Tensor weight, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("int8_linear", int8_linear); }
