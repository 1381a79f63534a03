// CPU features the kernels dispatch on at run time (GCC/Clang builtins, x86 only).
#pragma once

namespace tokenserve {

struct CpuFeatures {
  bool avx2_fma = false;     // AVX2 + FMA: the vector path of every kernel
  bool avx512f = false;      // AVX-512 foundation
  bool avx512bf16 = false;   // AVX-512 BF16 (vdpbf16ps)
  bool amx_bf16 = false;     // AMX tiles with bf16
};

inline const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    c.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    c.avx512f = __builtin_cpu_supports("avx512f");
#if defined(__GNUC__) && __GNUC__ >= 12
    c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    c.amx_bf16 = __builtin_cpu_supports("amx-bf16");
#endif
#endif
    return c;
  }();
  return f;
}

}  // namespace tokenserve
