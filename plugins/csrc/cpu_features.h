// Instruction sets beyond the library's AVX2 baseline, chosen at run time: a kernel compiled for AVX-512 VNNI
// (through MS_AVX512_VNNI on its functions) runs only where cpu_has_avx512_vnni() says so.
#pragma once

#define MS_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
// AVX-512VL for its 32 ymm registers; `flatten` inlines the (AVX2) tiles a function calls so they use them.
#define MS_AVX512VL_FLAT __attribute__((target("avx512f,avx512vl"), flatten))
// AVX512_BF16's dot products of bf16 pairs into fp32 lanes (bf16_linear.cpp).
#define MS_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace morphserve_cpu {

inline bool cpu_has_avx512_vnni() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512vnni");
  return ok;
}

inline bool cpu_has_avx512_vl() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return ok;
}

inline bool cpu_has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
}

}  // namespace morphserve_cpu
