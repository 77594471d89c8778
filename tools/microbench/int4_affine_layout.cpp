// Synthetic one-row INT4 VNNI pass: where the scales and zeros sit decides how fast one core streams it.
//
// The engine's all-INT4 batch-1 step reads its INT4 weights at ~7-8 GB/s per core on a host whose core streams a
// plain read at 15-25 GB/s (docs/history/fused-decode.md, "One core's rate, not the memory"). This loop does the same
// inner work as int4_tile.h's rows_q8_vnni<1> for a 4-block tile (two 64-byte loads, nibble split, four
// vpdpbusd per 128 bytes; per group of 32 inputs a convert, the scale and zero FMAs), over 256 MB, with the
// group's 128 bytes of bf16 scales and zeros read from:
//   - a separate array, block-major (Packed::block_affine today: four short strided streams per tile),
//   - the same array, tile-group-major (one sequential stream beside the nibbles),
//   - interleaved after each group's 512 bytes of nibbles (one stream),
//   - nowhere (nibbles only, the upper bound).
// Not part of the build: g++ -O3 -march=native -o /tmp/int4_affine_layout tools/microbench/int4_affine_layout.cpp
// and run it on an idle core (taskset -c 1 /tmp/int4_affine_layout).
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
constexpr int64_t K = 576, G = 32, GROUPS = K / G, KSTEPS = K / 8;
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512 bf16x16(const uint16_t* a, const uint16_t* b) {
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)), _mm_loadu_si128((const __m128i*)b), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// mode 0: separate affine (block-major: (b*GROUPS + g) * 16 uint16), 1: interleaved (per tile per group 128 B of
// affine after the group's 512 B of nibbles), 2: no affine
template <int MODE>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) float pass(const uint8_t* q, const uint16_t* aff, int64_t tiles) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), xe = _mm512_set1_epi32(0x01020304), xo = _mm512_set1_epi32(0x05060708);
  float out = 0;
  const int64_t tile_bytes = MODE == 1 ? GROUPS * 640 : GROUPS * 512;
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t* tq = q + t * tile_bytes;
    __m512 tot0 = _mm512_setzero_ps(), tot1 = tot0;
    for (int64_t g = 0; g < GROUPS; ++g) {
      const uint8_t* gq = tq + g * (MODE == 1 ? 640 : 512);
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
      for (int k = 0; k < 512; k += 128) {
        const __m512i v0 = _mm512_loadu_si512(gq + k), v1 = _mm512_loadu_si512(gq + k + 64);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(v0, low4), xe);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4), xo);
        a2 = _mm512_dpbusd_epi32(a2, _mm512_and_si512(v1, low4), xe);
        a3 = _mm512_dpbusd_epi32(a3, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4), xo);
      }
      const __m512 d = _mm512_set1_ps(0.01f);
      __m512 p0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), d);
      __m512 p1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a2, a3)), d);
      if (MODE == 2) { tot0 = _mm512_add_ps(tot0, p0); tot1 = _mm512_add_ps(tot1, p1); continue; }
      const uint16_t *b0, *b1, *b2, *b3;
      if (MODE == 3) {
        const uint16_t* ga = aff + (t * GROUPS + g) * 64;
        b0 = ga; b1 = ga + 16; b2 = ga + 32; b3 = ga + 48;
      } else if (MODE == 0) {
        const int64_t blk = t * 4;
        b0 = aff + ((blk + 0) * GROUPS + g) * 16; b1 = aff + ((blk + 1) * GROUPS + g) * 16;
        b2 = aff + ((blk + 2) * GROUPS + g) * 16; b3 = aff + ((blk + 3) * GROUPS + g) * 16;
      } else {
        const uint16_t* ga = reinterpret_cast<const uint16_t*>(gq + 512);
        b0 = ga; b1 = ga + 16; b2 = ga + 32; b3 = ga + 48;
      }
      const __m512 s0 = bf16x16(b0, b1), c0 = bf16x16(b0 + 8, b1 + 8), s1 = bf16x16(b2, b3), c1 = bf16x16(b2 + 8, b3 + 8);
      tot0 = _mm512_fmadd_ps(p0, s0, tot0); tot0 = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), c0, tot0);
      tot1 = _mm512_fmadd_ps(p1, s1, tot1); tot1 = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), c1, tot1);
    }
    out += _mm512_reduce_add_ps(_mm512_add_ps(tot0, tot1));
  }
  return out;
}
int main() {
  const int64_t tiles = (256LL << 20) / (GROUPS * 640);
  const int64_t qbytes = tiles * GROUPS * 640;
  uint8_t* q = (uint8_t*)aligned_alloc(4096, qbytes);
  uint16_t* aff = (uint16_t*)aligned_alloc(4096, tiles * 4 * GROUPS * 32);
  for (int64_t i = 0; i < qbytes; ++i) q[i] = uint8_t(i * 2654435761u >> 24) & 0x77;
  for (int64_t i = 0; i < tiles * 4 * GROUPS * 16; ++i) aff[i] = 0x3f80;
  auto run = [&](const char* name, int64_t bytes, auto f) {
    std::vector<double> t;
    for (int r = 0; r < 7; ++r) { double a = now(); volatile float x = f(); (void)x; t.push_back(now() - a); }
    std::sort(t.begin(), t.end());
    printf("%-40s %6.1f GB/s (nibbles+affine bytes / time)\n", name, bytes / t[3] / 1e9);
  };
  const int64_t nib = tiles * GROUPS * 512, afb = tiles * GROUPS * 128;
  for (int rep = 0; rep < 2; ++rep) {
    run("separate affine (as Packed today)", nib + afb, [&] { return pass<0>(q, aff, tiles); });
    run("affine interleaved after each group", nib + afb, [&] { return pass<1>(q, aff, tiles); });
    run("separate affine, tile-group-major", nib + afb, [&] { return pass<3>(q, aff, tiles); });
    run("no affine (nibbles only)", nib, [&] { return pass<2>(q, aff, tiles); });
  }
}
