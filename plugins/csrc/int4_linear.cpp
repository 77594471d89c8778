// INT4 weight-only linear on AVX2 CPUs with fp32 activations: y[M, N] = x[M, K] @ W[N, K]^T, where
// W = q * s + (z - 8 s) per group of G inputs (the portable fragment format of plugins/quant_matmul.py:
// nibbles [N, K/2], element 2i in the high nibble; scale s and zero z in bf16), or, for a GGUF's Q4_1 blocks
// kept as they are, W = q * d + m with the block's fp16 scale d and min m (int4_pack given fp16 instead of bf16).
//
// Why this shape: decode reads every weight once per step, so the nibbles must be unpacked with as few
// instructions as reading them costs. The first version (weights unpacked to fp32 and dequantized in
// registers, one output per accumulator) spent ~12 vector instructions per 16 weights and read its nibbles at
// 5 GB/s on one core, no faster than the fp16 weights it replaced.
// - Platform packing (`int4_pack`, once at load): blocks of 8 weight rows, one row per AVX2 lane. A 32-byte
//   load holds 8 consecutive inputs of each of the 8 rows (input k = 8c + j in bits 4j..4j+3 of row r's
//   32-bit word), so one shift and one mask give the next input of all 8 rows: no shuffles, no permuted x,
//   and the 8 outputs come out as one vector (no horizontal sums). Scales and zeros are regrouped the same way
//   (still bf16, the same bytes) and stored after each group's nibbles, in the same stream (Packed).
// - Scaling per group, not per weight: y = sum_g s_g * (x_g . q_g) + (z_g - 8 s_g) * sum(x_g). The inner loop
//   is one mask, one int->float convert and one FMA per 8 weights and row of x (nibble_in_place).
// - Four row blocks per tile: four independent FMA chains at batch 1.
// - Up to two rows of x the nibbles are unpacked in registers; more rows (up to `max_skinny_rows`) unpack
//   each group of the tile once into an L1 buffer that every row then reads. Both sum in the same order, so a
//   row's result does not depend on the batch. Prefill chunks (more rows) dequantize to a transient matrix
//   and run MKL, or go through the same tiles 32 rows at a time (prefill_mode, below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "int4_tile.h"

namespace {

using namespace morphserve_cpu::int4;

void check_portable(const at::Tensor& qweight, const at::Tensor& sz, int64_t G) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "int4_pack: contiguous uint8 qweight [N, K/2] expected");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  TORCH_CHECK(G > 0 && G % 8 == 0 && K % G == 0, "int4: group size ", G, " must be a multiple of 8 that divides K = ", K);
  TORCH_CHECK((sz.scalar_type() == at::kBFloat16 || sz.scalar_type() == at::kHalf) && sz.is_contiguous() &&
                  sz.dim() == 3 && sz.size(0) == N && sz.size(1) == K / G && sz.size(2) == 2,
              "int4_pack: contiguous scales_zeros [N, K/G, 2] = [", N, ", ", K / G, ", 2] expected, bf16 (s, z) or "
              "fp16 (Q4_1's d, m)");
}

// Portable nibbles and [N, K/G, 2] scales/zeros -> the kernel's blocks (rows past N are zero). bf16 (s, z): AWQ's
// w = (q - 8) s + z; fp16 (d, m): Q4_1's w = q d + m. The 16-bit values are copied as they are either way, and the
// empty second tensor returned carries the form (its dtype: check_packed).
std::tuple<at::Tensor, at::Tensor> int4_pack(const at::Tensor& qweight, const at::Tensor& sz, int64_t G) {
  check_portable(qweight, sz, G);
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2, groups = K / G, blocks = (N + kLanes - 1) / kLanes;
  // Per block, per group: its G/8 chunks of 32 bytes, then 32 bytes of scales and zeros (Packed).
  at::Tensor packed = at::zeros({blocks, K / 8 + groups, kLanes * 4}, at::kByte);
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sz.data_ptr());
  uint32_t* pq = reinterpret_cast<uint32_t*>(packed.data_ptr<uint8_t>());
  const Packed layout{pq, K, G, groups, blocks};
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
      for (int t = 0; t < 2; ++t)
        const_cast<uint16_t*>(layout.block_affine(b, g))[t * kLanes + r] = s[(n * groups + g) * 2 + t];
  }
  return {packed, at::empty({0}, sz.scalar_type())};  // the scales and zeros are inside `packed`
}


// fp32 -> bf16 bits, rounded to nearest even: torch's conversion for every finite value (a dequantized weight
// is finite), so the bf16 prefill multiplies exactly the weights that the fp32 dequantization followed by
// `copy_` to bf16 gave, without writing and re-reading the fp32 matrix.
inline __m128i bf16_round(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 8x8 transpose: in v[j] lane r (input j of row r) -> out[r] lane j (row r's 8 consecutive inputs).
inline void transpose8(const __m256 (&v)[8], __m256 (&out)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    out[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

inline void store_row(float* out, __m256 row) { _mm256_storeu_ps(out, row); }
inline void store_row(uint16_t* out, __m256 row) { _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bf16_round(row)); }

// The weight [N, K] (w = q * s + c, affine8) into `out`, fp32 or bf16 (rounded from the same fp32 values): the
// prefill path's and the tests' reference. Each 8-input chunk of a block is 8 vectors of 8 rows, transposed to
// 8 row pieces in registers (not a scalar scatter: the prefill path dequantizes a whole layer per chunk).
template <typename Out>
void dequantize_into(const Packed& p, int64_t N, Out* out) {
  const int64_t blocks = (N + kLanes - 1) / kLanes, K = p.K;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(kLanes, N - b * kLanes);
      for (int64_t c = 0; c < K / 8; ++c) {
        __m256 s, off;  // Q4_1: fma(q, d, m) is gguf's fp32 d * q + m bit for bit (d * q is exact)
        affine8(p, p.block_affine(b, c * 8 / p.G), s, off);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.word(b, c)));
        const __m256 w[8] = {_mm256_fmadd_ps(nibble<0>(v), s, off), _mm256_fmadd_ps(nibble<1>(v), s, off),
                             _mm256_fmadd_ps(nibble<2>(v), s, off), _mm256_fmadd_ps(nibble<3>(v), s, off),
                             _mm256_fmadd_ps(nibble<4>(v), s, off), _mm256_fmadd_ps(nibble<5>(v), s, off),
                             _mm256_fmadd_ps(nibble<6>(v), s, off), _mm256_fmadd_ps(nibble<7>(v), s, off)};
        __m256 row[8];
        transpose8(w, row);
        for (int64_t r = 0; r < rows; ++r) store_row(out + (b * kLanes + r) * K + c * 8, row[r]);
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

// Prefill chunks' path: dequantize and multiply with MKL in fp32 (0) or with bf16 inputs and fp32 accumulation
// (1: MKL's bf16 GEMM runs ~4.4x faster than its fp32 one on CPUs with AVX512_BF16, measured at 256 rows, one
// core), or the decode tiles row chunk by row chunk (2: on AVX-512 VNNI the int8 tiles multiply 1.3-1.9x faster
// than the bf16 GEMM at 128-512 rows, with no dequantized copy, and every prompt row gets the numerics a decode
// row gets). Process-wide, set by `int4_prefill_mode`.
constexpr int kPrefillFloat32 = 0, kPrefillBf16 = 1, kPrefillDecodeTiles = 2;
std::atomic<int> prefill_mode{kPrefillFloat32};

// Rows per pass of the decode tiles over a tile range in prefill mode 2 (the tiles' accumulators live on the
// stack, at most kMaxRows; 32 and 64 ran alike at 128 rows, 32 was 5% faster at 512).
constexpr int64_t kPrefillRowChunk = 32;

// Prefill-sized input: dequantize into a per-thread scratch (kept: a fresh multi-MB tensor per call would be
// mapped and faulted in anew each time) and let MKL multiply.
at::Tensor dequantized_linear(const at::Tensor& input, const Packed& p, int64_t N) {
  if (prefill_mode.load(std::memory_order_relaxed) == kPrefillBf16) {
    // Straight to bf16 (a raw buffer wrapped per call, as a kept tensor would carry the inference mode it was
    // made in into calls made outside it): the fp32 matrix and its copy pass cost 10% of a 16-stream run.
    thread_local std::vector<uint16_t> scratch16;
    if (static_cast<int64_t>(scratch16.size()) < N * p.K) scratch16.resize(N * p.K);
    dequantize_into(p, N, scratch16.data());
    const at::Tensor wb = at::from_blob(scratch16.data(), {N, p.K}, at::kBFloat16);
    return at::linear(input.to(at::kBFloat16), wb).to(at::kFloat);
  }
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
  const bool tiles_only = prefill_mode.load(std::memory_order_relaxed) == kPrefillDecodeTiles;
  if (M > max_skinny_rows && !tiles_only) return dequantized_linear(scaled ? input * *pre_scale : input, p, N);
  const at::Tensor x = input.contiguous();
  at::Tensor y = at::empty({M, N}, at::kFloat);
  if (M == 0 || N == 0) return y;
  const bool q8 = int8_activations(K, G);
  std::vector<float> xw(scaled ? M * K : 0), xsum(M * p.groups), xs(q8 ? 0 : M * K), xd(q8 ? M * K / kQBlock : 0);
  std::vector<int8_t> xq(q8 ? M * K : 0);
  prepare_input(x.data_ptr<float>(), M, K, G, scaled ? pre_scale->data_ptr<float>() : nullptr, xw.data(), xsum.data(),
                xs.data(), q8 ? xq.data() : nullptr, xd.data());
  float* yp = y.data_ptr<float>();
  const int64_t chunk = M > max_skinny_rows ? kPrefillRowChunk : M;  // decode batches: one pass
  at::parallel_for(0, num_tiles(p), 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buf;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {  // a thread's tiles stay in its caches across the row chunks
      const Prepared in{q8 ? nullptr : xs.data() + m0 * K, xsum.data() + m0 * p.groups, q8 ? xq.data() + m0 * K : nullptr,
                        q8 ? xd.data() + m0 * (K / kQBlock) : nullptr};
      run_tiles(p, t0, t1, in, std::min(chunk, M - m0), yp + m0 * N, N, buf);
    }
  });
  return y;
}

// Sets the skinny path's activations (8 or 32 bits, see int4_tile.h) when `bits` > 0; returns the setting in
// force before the call.
int64_t int4_activation_bits(int64_t bits) {
  TORCH_CHECK(bits == 0 || bits == 8 || bits == 32, "int4_activation_bits: 8 (int8) or 32 (fp32) expected, got ", bits,
              " (0 reads the setting)");
  const int previous = activation_bits.load();
  if (bits > 0) activation_bits.store(static_cast<int>(bits));
  return previous;
}

// Lets full INT4 tiles use AVX-512 VNNI where the CPU has it (1) or not (0) when `on` >= 0; returns the setting
// before the call. The results are bitwise the same either way (exact integer sums): this exists to measure.
int64_t int4_vnni(int64_t on) {
  TORCH_CHECK(on >= -1 && on <= 1, "int4_vnni: 0 (off), 1 (where the CPU has it) or -1 (read) expected, got ", on);
  const int previous = use_vnni.load();
  if (on >= 0) use_vnni.store(static_cast<int>(on));
  return previous;
}

// Sets the int8-activation passes' software prefetch distance in bytes (0: none) when `bytes` >= 0; returns the
// setting before the call. Results are bitwise the same whatever it is: this exists to measure.
int64_t int4_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= -1 && bytes <= (1 << 20), "int4_prefetch: 0..1048576 bytes ahead or -1 (read) expected, got ", bytes);
  const int64_t previous = prefetch_bytes.load();
  if (bytes >= 0) prefetch_bytes.store(bytes);
  return previous;
}

// Sets the prefill path (kPrefillFloat32, kPrefillBf16 or kPrefillDecodeTiles) when `mode` >= 0; returns the
// setting before the call.
int64_t int4_prefill_mode(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= kPrefillDecodeTiles, "int4_prefill_mode: 0 (fp32), 1 (bf16), 2 (decode tiles) or -1 "
              "(read) expected, got ", mode);
  const int previous = prefill_mode.load();
  if (mode >= 0) prefill_mode.store(static_cast<int>(mode));
  return previous;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("int4_prefill_mode(int mode) -> int", int4_prefill_mode);
  m.def("int4_vnni(int on) -> int", int4_vnni);
  m.def("int4_prefetch(int bytes) -> int", int4_prefetch);
  m.def("int4_activation_bits(int bits) -> int", int4_activation_bits);  // no tensors: a catch-all kernel
  m.def("int4_pack(Tensor qweight, Tensor scales_zeros, int group_size) -> (Tensor, Tensor)");
  m.def("int4_linear(Tensor input, Tensor packed, Tensor affine, Tensor? pre_scale, int out_features, int group_size, int max_skinny_rows) -> Tensor");
  m.def("int4_dequantize(Tensor packed, Tensor affine, int out_features, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) {
  m.impl("int4_pack", int4_pack);
  m.impl("int4_linear", int4_linear);
  m.impl("int4_dequantize", int4_dequantize);
}
