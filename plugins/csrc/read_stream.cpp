// A streaming read of a buffer, for the read-bandwidth floor (plugins/read_bandwidth.py): what the decode kernels
// could at best read per second. It only loads and adds 32-bit words (integer adds, four or eight independent
// chains: no floating-point latency in the way), on `threads` OpenMP threads each reading one contiguous slice,
// with an optional software prefetch `ahead` bytes on (as the INT4 and dense tiles ask for theirs), in 32-byte
// (AVX2) or 64-byte (AVX-512, where the CPU has it) loads. Returns the sum of the words so nothing is elided.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_features.h"

namespace {

int64_t hsum_epi32(__m256i v) {
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
  int64_t s = 0;
  for (int32_t x : lanes) s += x;
  return s;
}

int64_t read_avx2(const uint8_t* p, int64_t n, int64_t ahead) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    if (ahead > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead + 64), _MM_HINT_T0);
    }
    a0 = _mm256_add_epi32(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi32(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi32(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi32(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  int64_t s = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}

MS_AVX512_VNNI int64_t read_avx512(const uint8_t* p, int64_t n, int64_t ahead) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {
    if (ahead > 0)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(p + i + ahead + 64 * l), _MM_HINT_T0);
    a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(p + i + 192));
  }
  int64_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
  for (; i < n; ++i) s += p[i];
  return s;
}

// `wide`: 64-byte loads where the CPU has AVX-512 (else 32-byte ones); `threads` <= 0: omp_get_max_threads().
int64_t read_stream(const at::Tensor& buf, int64_t threads, int64_t ahead, bool wide) {
  TORCH_CHECK(buf.is_contiguous() && buf.device().is_cpu(), "read_stream: a contiguous CPU tensor expected");
  TORCH_CHECK(ahead >= 0 && ahead <= (1 << 20), "read_stream: prefetch distance 0..1048576 bytes, got ", ahead);
  const uint8_t* p = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t n = buf.numel() * buf.element_size();
  const int t = static_cast<int>(threads > 0 ? threads : omp_get_max_threads());
  const bool avx512 = wide && morphserve_cpu::cpu_has_avx512_vnni();
  std::vector<int64_t> sums(t, 0);
#pragma omp parallel num_threads(t)
  {
    const int id = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (n / nt + 4095) / 4096 * 4096;  // page-aligned slices
    const int64_t b = std::min<int64_t>(n, id * per), e = std::min<int64_t>(n, b + per);
    sums[id] = avx512 ? read_avx512(p + b, e - b, ahead) : read_avx2(p + b, e - b, ahead);
  }
  int64_t s = 0;
  for (int64_t x : sums) s += x;
  return s;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(morphserve, m) {
  m.def("read_stream(Tensor buf, int threads, int ahead, bool wide) -> int");
}
TORCH_LIBRARY_IMPL(morphserve, CPU, m) { m.impl("read_stream", read_stream); }
