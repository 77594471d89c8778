// The INT4 linear's register tiles (see int4_linear.cpp for the layout and why), shared by the per-op
// kernel and the fused decode layer (decode_layer.cpp): both run these loops, so their results are bitwise equal.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "cpu_tile.h"

namespace morphserve_cpu {
namespace int4 {

constexpr int64_t kLanes = 8;      // weight rows per block, one per AVX2 lane
constexpr int64_t kTileBlocks = 4;  // row blocks per tile: independent accumulators at batch 1
constexpr int64_t kRegRows = 2;     // rows of x up to which the nibbles are unpacked in registers
constexpr int64_t kBufRows = 3;     // rows of x per pass over the unpacked buffer (12 accumulators + 4 of 16 registers; 3 beat 2 by 1.1-1.3x)
constexpr int64_t kMaxRows = 64;    // skinny limit accepted (the per-tile accumulators live on the stack)
constexpr int64_t kQBlock = 32;     // INT8 activations: inputs per activation scale (llama.cpp's Q8_0 block)
constexpr int64_t kQRows = 4;       // INT8 activations: rows of x per pass over a group's nibbles

// Activations the skinny path multiplies the nibbles with: 32 (fp32, W4A16-like, exact products) or 8 (each
// row quantized to int8 per 32 inputs, absmax scale; integer dot products, 4 instructions per 64 weights and
// row against 26). Process-wide, set by `int4_activation_bits`; prefill chunks (dequantize + MKL) never come here.
inline std::atomic<int> activation_bits{8};

inline bool int8_activations(int64_t K, int64_t G) {
  return activation_bits.load(std::memory_order_relaxed) == 8 && G % kQBlock == 0 && K % kQBlock == 0;
}

// The packed weight: tiles of kTileBlocks blocks (the last may have fewer), stored one after the other, and in a
// tile its groups one after the other: group g holds chunks c = g G/8 .. (g+1) G/8 - 1 (inputs 8c..8c+7) of
// the tile's blocks side by side, then the group's scales and zeros, block by block. A tile is one contiguous
// stream of memory and consecutive tiles continue it (separate short streams per block left the hardware
// prefetcher behind: the nibbles streamed from memory at 9 GB/s on one core against 14 GB/s from L2; the scales
// and zeros, held apart block by block until 2026-12, were four more short streams per tile that a one-row pass
// stalled on: tools/microbench/int4_affine_layout.cpp, docs/fused-decode.md). Word r of block b's chunk c holds
// row 8b + r's inputs 8c + j at bits 4j. A block's scales and zeros for a group: 8 bf16 scales then 8 bf16
// zeros (rows 8b .. 8b + 7), 8 words.
struct Packed {
  const uint32_t* q;
  int64_t K, G, groups, blocks;
  // How a block's 8 affine words read (int4_pack chose it from the dtype it was given): false, AWQ's bf16 scale
  // s and zero z with w = (q - 8) s + z; true, GGUF Q4_1's fp16 scale d and min m, kept exactly, with w = q d + m.
  bool q4_1 = false;
  // Words of one block in one group: its G/8 chunks and its scales and zeros.
  int64_t block_group_words() const { return (G / 8 + 1) * kLanes; }
  // Group g's area in the tile of block b, and the blocks in that tile.
  const uint32_t* group_area(int64_t b, int64_t g, int64_t& nb) const {
    const int64_t t = b / kTileBlocks;
    nb = std::min(kTileBlocks, blocks - t * kTileBlocks);
    return q + (t * kTileBlocks * groups + g * nb) * block_group_words();
  }
  // Group g of the tile that holds block b0, as the hot loops walk it: chunk cc of block b0 + j is
  // `first + cc * stride + j * kLanes` (worked out once per group, not per chunk).
  struct Chunks {
    const uint32_t* first;
    int64_t stride;
    const uint32_t* at(int64_t cc) const { return first + cc * stride; }
  };
  Chunks chunks(int64_t b0, int64_t g) const {
    int64_t nb;
    const uint32_t* area = group_area(b0, g, nb);
    return {area + (b0 % kTileBlocks) * kLanes, nb * kLanes};
  }
  // Chunk c (inputs 8c..8c+7) of block b, anywhere (packing, dequantizing; the hot loops use `chunks`).
  const uint32_t* word(int64_t b, int64_t c) const { return chunks(b, c / (G / 8)).at(c % (G / 8)); }
  const uint16_t* block_affine(int64_t b, int64_t g) const {
    int64_t nb;
    const uint32_t* area = group_area(b, g, nb);
    return reinterpret_cast<const uint16_t*>(area + (nb * (G / 8) + b % kTileBlocks) * kLanes);
  }
};

// An input prepared for the tiles (prepare_input): per group sum(x_g), and either x pre-scaled for
// nibble_in_place (fp32 activations; xq null) or x quantized to int8 with one scale per kQBlock inputs.
struct Prepared {
  const float* xs;
  const float* xsum;
  const int8_t* xq;
  const float* xd;
};

inline __m256 bf16x8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline __m256 fp16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// A block's group affine `a` (Packed::block_affine) as w = q * s + c for its 8 rows: AWQ's c = z - 8 s (the
// expression the kernels always used), or Q4_1's d and m as they are (fp16 -> fp32 is exact).
inline void affine8(const Packed& p, const uint16_t* a, __m256& s, __m256& c) {
  if (p.q4_1) {
    s = fp16x8(a);
    c = fp16x8(a + kLanes);
    return;
  }
  s = bf16x8(a);
  c = _mm256_sub_ps(bf16x8(a + kLanes), _mm256_mul_ps(_mm256_set1_ps(8.f), s));
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

// The group's scaling into the running totals: tot += part * s + sum(x_g) * c (affine8).
template <int MT, int NB>
inline void finish_group(const Packed& p, int64_t b0, int64_t g, const float* xsum, int64_t groups,
                         __m256 (&part)[MT][NB], float* tot, int64_t ldt) {
  for (int b = 0; b < NB; ++b) {
    __m256 s, c;
    affine8(p, p.block_affine(b0 + b, g), s, c);
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
  const Packed::Chunks gc = p.chunks(b0, g);
  for (int64_t k = g * p.G; k < (g + 1) * p.G; k += 8) {
    __m256i v[NB];
    const uint32_t* chunk = gc.at((k - g * p.G) / 8);
    for (int b = 0; b < NB; ++b) v[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + b * kLanes));
    chunk_regs<MT, NB>(x + k, ldx, v, part);
  }
  finish_group<MT, NB>(p, b0, g, xsum, p.groups, part, tot, ldt);
}

// Group g of NB blocks unpacked to floats: buf[(kk * NB + b) * 8 + r] = q of row r of block b at input g*G+kk.
template <int NB>
inline void unpack_group(const Packed& p, int64_t b0, int64_t g, float* buf) {
  const Packed::Chunks gc = p.chunks(b0, g);
  for (int64_t kk = 0; kk < p.G; kk += 8)
    for (int b = 0; b < NB; ++b) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gc.at(kk / 8) + b * kLanes));
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

// MT rows of int8 x against NB blocks, group g: per 32 inputs, 16-bit sums of q * xq (unsigned nibble x signed
// byte, vpmaddubsw; 16 products of at most 15 * 127 fit in int16), widened and scaled by the block's d, then
// the group's affine as finish_group. Integer sums are exact, so a row's result does not depend on MT.
// xq holds each 8 inputs as [x0 x2 x4 x6 x1 x3 x5 x7] (quantize_row): the bytes the low and high nibbles of a
// row's word meet.
template <int MT, int NB>
inline void group_q8(const Packed& p, int64_t b0, int64_t g, const int8_t* xq, const float* xd, int64_t K,
                     const float* xsum, float* tot, int64_t ldt, int64_t ahead) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t qblocks = K / kQBlock;
  const Packed::Chunks gc = p.chunks(b0, g);
  __m256 part[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) part[m][b] = _mm256_setzero_ps();
  for (int64_t k0 = g * p.G; k0 < (g + 1) * p.G; k0 += kQBlock) {
    __m256i acc[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k0 + kQBlock; k += 8) {
      __m256i xe[MT], xo[MT];
      for (int m = 0; m < MT; ++m) {
        int32_t e, o;
        std::memcpy(&e, xq + m * K + k, 4);
        std::memcpy(&o, xq + m * K + k + 4, 4);
        xe[m] = _mm256_set1_epi32(e);
        xo[m] = _mm256_set1_epi32(o);
      }
      const uint32_t* chunk = gc.at((k - g * p.G) / 8);
      if (ahead > 0) {  // as rows_q8_vnni: the chunk's NB * 32 bytes, `ahead` bytes on
        const char* at = reinterpret_cast<const char*>(chunk) + ahead;
        for (int64_t line = 0; line < NB * 32; line += 64) _mm_prefetch(at + line, _MM_HINT_T0);
      }
      for (int b = 0; b < NB; ++b) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + b * kLanes));
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int m = 0; m < MT; ++m)
          acc[m][b] = _mm256_add_epi16(acc[m][b], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe[m]),
                                                                   _mm256_maddubs_epi16(hi, xo[m])));
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 d = _mm256_set1_ps(xd[m * qblocks + k0 / kQBlock]);
      for (int b = 0; b < NB; ++b)
        part[m][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(acc[m][b], ones)), d, part[m][b]);
    }
  }
  finish_group<MT, NB>(p, b0, g, xsum, p.groups, part, tot, ldt);
}

// AVX-512 VNNI (`vpdpbusd`: 64 unsigned nibbles times 64 signed bytes, summed in fours into 16 int32 lanes) for
// a full tile's 4 blocks, two blocks per zmm: per 32 inputs the same exact integer sums as group_q8, then the
// same convert and FMA per block, so the results are bitwise equal to it. One row keeps the low and the high
// nibbles' products in separate chains (the dependent dpbusd latency was what made a ymm version slower);
// more rows have a chain each. Compiled for AVX-512 by target attribute; run only where the CPU has it.

// Process-wide: whether full tiles take group_q8_vnni where the CPU has it (int4_vnni op: A/B measurements).
inline std::atomic<int> use_vnni{1};

// Process-wide: how far ahead (bytes of the tile stream) the int8-activation passes (rows_q8_vnni, group_q8) ask
// for their nibbles with a software prefetch, 0 for none (int4_prefetch op: A/B measurements). At one row a pass
// computes so little per cache line that the hardware prefetcher alone kept one core's reads at ~70% of a plain
// streaming sum; asking 4 KB ahead (tiles continue each other's stream, so it runs on into the next tile) made the
// all-INT4 batch-1 step 1.12-1.21x faster with the VNNI pass and 1.16-1.18x with the AVX2 one, in step-alternating
// A/Bs on one core (2-8 KB alike, T0 and T1 hints alike; batch 8 1.0-1.09x). Asking for the first 4 KB of each
// linear's range a phase early (in the fused decode call) measured 0.99-1.02x and was not kept.
inline std::atomic<int64_t> prefetch_bytes{4096};

// Below this many rows the AVX2 loop is kept. With the totals in registers (rows_q8_vnni) the VNNI pass is the
// faster one from one row: 30-40 MB of INT4 weights streamed on one core, 1.14x at 1 row and 1.9x at 2-3 rows
// (where the AVX2 loop reads the group once per row). The earlier VNNI tiles, which went through memory per
// group, were 5-6% slower than AVX2 at 1-2 rows in the engine and ran from 4.
constexpr int64_t kVnniMinRows = 1;

inline bool vnni_tiles(int64_t M) {
  return M >= kVnniMinRows && use_vnni.load(std::memory_order_relaxed) != 0 && cpu_has_avx512_vnni();
}

// Two blocks' 8 bf16 values each (`a` for block b, `b` for block b + 1) as one zmm of floats.
MS_AVX512_VNNI inline __m512 bf16x16(const uint16_t* a, const uint16_t* b) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Two blocks' 8 fp16 values each, as bf16x16 does for bf16.
MS_AVX512_VNNI inline __m512 fp16x16(const uint16_t* a, const uint16_t* b) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_cvtph_ps(v);
}

// MT rows of int8 x against a full tile's 4 blocks, over all groups, into tot [MT, ldt]. Per group it forms the
// same exact integer sums as group_q8 and applies the same fp32 operations per output in the same order
// (convert, FMA with d, then finish_group's two FMAs), so the results are bitwise equal to the AVX2 path. The
// running totals stay in zmm registers (two blocks per register) for the whole row pass, where group by group
// they went through memory (a load and a store per row and block and group, which cost more than the dpbusd).
template <int MT>
MS_AVX512_VNNI inline void rows_q8_vnni(const Packed& p, int64_t b0, const int8_t* xq, const float* xd, int64_t K,
                                        const float* xsum, float* tot, int64_t ldt, int64_t ahead) {
  constexpr int NZ = kTileBlocks / 2, NC = MT == 1 ? 2 : 1;
  static_assert(kTileBlocks % 2 == 0, "two blocks per zmm");
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  const int64_t qblocks = K / kQBlock;
  __m512 total[MT][NZ];
  for (int m = 0; m < MT; ++m)
    for (int z = 0; z < NZ; ++z) total[m][z] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    const Packed::Chunks gc = p.chunks(b0, g);
    __m512 part[MT][NZ];
    for (int m = 0; m < MT; ++m)
      for (int z = 0; z < NZ; ++z) part[m][z] = _mm512_setzero_ps();
    for (int64_t k0 = g * p.G; k0 < (g + 1) * p.G; k0 += kQBlock) {
      __m512i acc[MT][NZ][NC];
      for (int m = 0; m < MT; ++m)
        for (int z = 0; z < NZ; ++z)
          for (int c = 0; c < NC; ++c) acc[m][z][c] = _mm512_setzero_si512();
      for (int64_t k = k0; k < k0 + kQBlock; k += 8) {
        const uint32_t* chunk = gc.at((k - g * p.G) / 8);
        if (ahead > 0) {  // the chunk is NZ * 64 bytes: one prefetch per cache line, `ahead` bytes on
          const char* at = reinterpret_cast<const char*>(chunk) + ahead;
          for (int z = 0; z < NZ; ++z) _mm_prefetch(at + 64 * z, _MM_HINT_T0);
        }
        for (int z = 0; z < NZ; ++z) {
          // blocks b0 + 2z and b0 + 2z + 1 of a full tile sit side by side in each chunk (Packed)
          const __m512i v = _mm512_loadu_si512(chunk + 2 * z * kLanes);
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int m = 0; m < MT; ++m) {
            int32_t e, o;
            std::memcpy(&e, xq + m * K + k, 4);
            std::memcpy(&o, xq + m * K + k + 4, 4);
            acc[m][z][0] = _mm512_dpbusd_epi32(acc[m][z][0], lo, _mm512_set1_epi32(e));
            acc[m][z][NC - 1] = _mm512_dpbusd_epi32(acc[m][z][NC - 1], hi, _mm512_set1_epi32(o));
          }
        }
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 d = _mm512_set1_ps(xd[m * qblocks + k0 / kQBlock]);
        for (int z = 0; z < NZ; ++z) {
          const __m512i s = NC == 2 ? _mm512_add_epi32(acc[m][z][0], acc[m][z][NC - 1]) : acc[m][z][0];
          part[m][z] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, part[m][z]);
        }
      }
    }
    for (int z = 0; z < NZ; ++z) {  // finish_group, two blocks at a time: tot += part * s + sum(x_g) * c
      const uint16_t* a0 = p.block_affine(b0 + 2 * z, g);
      const uint16_t* a1 = p.block_affine(b0 + 2 * z + 1, g);
      __m512 s, c;  // as affine8, two blocks at a time
      if (p.q4_1) {
        s = fp16x16(a0, a1);
        c = fp16x16(a0 + kLanes, a1 + kLanes);
      } else {
        s = bf16x16(a0, a1);
        c = _mm512_sub_ps(bf16x16(a0 + kLanes, a1 + kLanes), _mm512_mul_ps(eight, s));
      }
      for (int m = 0; m < MT; ++m) {
        total[m][z] = _mm512_fmadd_ps(part[m][z], s, total[m][z]);
        total[m][z] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * p.groups + g]), c, total[m][z]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(tot + m * ldt + 2 * z * kLanes, total[m][z]);
}

// All M rows of x against the NB blocks starting at b0; y columns n0 = b0 * 8 .. (the valid ones of N).
template <int NB>
inline void tile(const Packed& p, int64_t b0, const Prepared& in, int64_t M, float* y, int64_t N,
                 std::vector<float>& buf) {
  constexpr int64_t ldt = NB * kLanes;
  alignas(32) float tot[kMaxRows * ldt];
  std::memset(tot, 0, sizeof(float) * M * ldt);
  const int64_t K = p.K, qblocks = K / kQBlock;
  const float* x = in.xs;
  const float* xsum = in.xsum;
  // Only the first pass of rows streams the tile from memory; later passes find it in the caches.
  const int64_t ahead = prefetch_bytes.load(std::memory_order_relaxed);
  if (NB == kTileBlocks && in.xq != nullptr && vnni_tiles(M)) {
    int64_t m = 0;
    for (; m + kQRows <= M; m += kQRows)
      rows_q8_vnni<kQRows>(p, b0, in.xq + m * K, in.xd + m * qblocks, K, xsum + m * p.groups, tot + m * ldt, ldt, m == 0 ? ahead : 0);
    if (M - m == 3) rows_q8_vnni<3>(p, b0, in.xq + m * K, in.xd + m * qblocks, K, xsum + m * p.groups, tot + m * ldt, ldt, m == 0 ? ahead : 0);
    else if (M - m == 2) rows_q8_vnni<2>(p, b0, in.xq + m * K, in.xd + m * qblocks, K, xsum + m * p.groups, tot + m * ldt, ldt, m == 0 ? ahead : 0);
    else if (M - m == 1) rows_q8_vnni<1>(p, b0, in.xq + m * K, in.xd + m * qblocks, K, xsum + m * p.groups, tot + m * ldt, ldt, m == 0 ? ahead : 0);
  } else {
    for (int64_t g = 0; g < p.groups; ++g) {
      if (in.xq != nullptr) {
        int64_t m = 0;
        for (; m + kQRows <= M; m += kQRows)
          group_q8<kQRows, NB>(p, b0, g, in.xq + m * K, in.xd + m * qblocks, K, xsum + m * p.groups, tot + m * ldt, ldt, m == 0 ? ahead : 0);
        for (; m < M; ++m)
          group_q8<1, NB>(p, b0, g, in.xq + m * K, in.xd + m * qblocks, K, xsum + m * p.groups, tot + m * ldt, ldt, m == 0 ? ahead : 0);
        continue;
      }
      if (M <= kRegRows) {
        if (M == 2) group_regs<2, NB>(p, b0, g, x, K, xsum, tot, ldt);
        else group_regs<1, NB>(p, b0, g, x, K, xsum, tot, ldt);
        continue;
      }
      unpack_group<NB>(p, b0, g, buf.data());
      int64_t m = 0;
      for (; m + kBufRows <= M; m += kBufRows)
        group_buf<kBufRows, NB>(p, b0, g, buf.data(), x + m * K, K, xsum + m * p.groups, tot + m * ldt, ldt);
      if (M - m == 2) group_buf<2, NB>(p, b0, g, buf.data(), x + m * K, K, xsum + m * p.groups, tot + m * ldt, ldt);
      else if (M - m == 1) group_buf<1, NB>(p, b0, g, buf.data(), x + m * K, K, xsum + m * p.groups, tot + m * ldt, ldt);
    }
  }
  const int64_t n0 = b0 * kLanes, nt = std::min<int64_t>(ldt, N - n0);
  for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, tot + m * ldt, sizeof(float) * nt);
}

// Row x [K] as int8 with one scale per kQBlock inputs (absmax / 127, rounded to nearest even), each 8 inputs
// stored [x0 x2 x4 x6 x1 x3 x5 x7] for group_q8.
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d) {
  for (int64_t k0 = 0; k0 < K; k0 += kQBlock) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t k = k0; k < k0 + kQBlock; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float a = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    d[k0 / kQBlock] = a / 127.f;
    const float inv = a > 0.f ? 127.f / a : 0.f;
    for (int64_t k = k0; k < k0 + kQBlock; k += 8)
      for (int j = 0; j < 8; ++j)
        q[k + (j % 2) * 4 + j / 2] = static_cast<int8_t>(std::nearbyint(x[k + j] * inv));
  }
}

// An input ready for the tiles, row by row: x * pre_scale (when given; the same fp32 products torch's multiply
// gives), per group sum(x_g) (the zero-point term; 8 lanes then their sum, a fixed order per row; with int8
// activations the sum of the quantized x, block by block), and x either
// pre-scaled for nibble_in_place (`xq` null) or quantized (quantize_row). K and G are multiples of 8
// (check_packed). `scaled` [M * K] scratch is used only with a pre_scale; `xsum` [M * groups], `xs` [M * K]
// (fp32 activations), `xq` [M * K] and `xd` [M * K / kQBlock] (int8).
inline void prepare_input(const float* x, int64_t M, int64_t K, int64_t G, const float* pre_scale, float* scaled,
                          float* xsum, float* xs, int8_t* xq = nullptr, float* xd = nullptr) {
  const __m256 pow16 = _mm256_setr_ps(1.f, 1.f / 16, 1.f / 256, 1.f / 4096, 1.f / 65536, 1.f / 1048576,
                                      1.f / 16777216, 1.f);  // x[k] * 16^-(k % 8) for k % 8 < 7: the partner of nibble_in_place
  const int64_t groups = K / G;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    if (pre_scale != nullptr) {
      float* sr = scaled + m * K;
      for (int64_t k = 0; k < K; k += 8)
        _mm256_storeu_ps(sr + k, _mm256_mul_ps(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(pre_scale + k)));
      xr = sr;
    }
    if (xq != nullptr) {
      // The zero-point term takes the quantized x too (as llama.cpp's Q8_1 block sum does): then the row
      // multiplies the weight w = q s + (z - 8 s) by one x, and its rounding error meets w, not the larger q s.
      int8_t* qr = xq + m * K;
      float* dr = xd + m * (K / kQBlock);
      quantize_row(xr, K, qr, dr);
      for (int64_t g = 0; g < groups; ++g) {
        float sum = 0.f;
        for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += kQBlock) {
          int32_t isum = 0;
          for (int64_t k = k0; k < k0 + kQBlock; ++k) isum += qr[k];
          sum += dr[k0 / kQBlock] * static_cast<float>(isum);
        }
        xsum[m * groups + g] = sum;
      }
      continue;
    }
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc = _mm256_loadu_ps(xr + g * G);
      for (int64_t k = g * G + 8; k < (g + 1) * G; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(xr + k));
      xsum[m * groups + g] = hsum(acc);
    }
    for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(xs + m * K + k, _mm256_mul_ps(_mm256_loadu_ps(xr + k), pow16));
  }
}

inline Packed check_packed(const at::Tensor& packed, const at::Tensor& affine, int64_t N, int64_t G) {
  TORCH_CHECK(G > 0 && G % 8 == 0, "int4: group size ", G, " must be a multiple of 8");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kLanes * 4 &&
                  packed.is_contiguous(),
              "int4_linear: packed weight [N/8, K/8 + K/G, 32] uint8 from int4_pack expected, got ", packed.sizes());
  TORCH_CHECK(packed.size(1) % (G / 8 + 1) == 0, "int4: group size ", G, " does not fit the packed weight's ",
              packed.size(1), " chunks of 32 bytes per block (K/8 + K/G; packed with another group size?)");
  const int64_t blocks = packed.size(0), groups = packed.size(1) / (G / 8 + 1), K = groups * G;
  TORCH_CHECK(N > (blocks - 1) * kLanes && N <= blocks * kLanes, "int4_linear: ", N, " output features do not fit ",
              blocks, " packed blocks of 8 rows");
  TORCH_CHECK(affine.numel() == 0 && (affine.scalar_type() == at::kBFloat16 || affine.scalar_type() == at::kHalf),
              "int4_linear: the scales and zeros are inside the packed weight (int4_pack gives an empty second "
              "tensor, bf16 or fp16), got a ", affine.scalar_type(), " tensor of ", affine.sizes());
  // NOTE: the empty tensor's dtype is the affine's form (bf16: AWQ's s and z; fp16: Q4_1's d and m): it travels
  // with the packed weight through every op and the fused layer's arguments without a new argument anywhere.
  return Packed{reinterpret_cast<const uint32_t*>(packed.data_ptr<uint8_t>()), K, G, K / G, blocks,
                affine.scalar_type() == at::kHalf};
}

inline int64_t num_tiles(const Packed& p) { return (p.blocks + kTileBlocks - 1) / kTileBlocks; }

// Tiles [t0, t1) of y [M, N] from a prepared input; `buf`: this thread's unpack buffer (grown here when needed).
inline void run_tiles(const Packed& p, int64_t t0, int64_t t1, const Prepared& in, int64_t M, float* y, int64_t N,
                      std::vector<float>& buf) {
  if (in.xq == nullptr && M > kRegRows && static_cast<int64_t>(buf.size()) < kTileBlocks * p.G * kLanes) buf.resize(kTileBlocks * p.G * kLanes);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t b0 = t * kTileBlocks, nb = std::min(kTileBlocks, p.blocks - b0);
    if (nb == kTileBlocks) {
      tile<kTileBlocks>(p, b0, in, M, y, N, buf);
    } else {
      for (int64_t b = b0; b < b0 + nb; ++b) tile<1>(p, b, in, M, y, N, buf);
    }
  }
}

}  // namespace int4
}  // namespace morphserve_cpu
