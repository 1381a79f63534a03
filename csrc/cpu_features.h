// CPU features the kernels dispatch on at run time (GCC/Clang builtins, x86 only).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tokenserve {

struct CpuFeatures {
  bool avx2_fma = false;     // AVX2 + FMA: the vector path of every kernel
  bool avx512f = false;      // AVX-512 foundation
  bool avx512bf16 = false;   // AVX-512 BF16 (vdpbf16ps)
  bool avx512vnni = false;   // AVX-512 F + BW + VL + VNNI (vpdpwssd: the block-quantised GEMMs)
  bool amx_bf16 = false;     // AMX tiles with bf16
  bool amx_int8 = false;     // AMX tiles with int8 (and AVX-512 VBMI, which its kernels use)
};

inline const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    c.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    c.avx512f = __builtin_cpu_supports("avx512f");
    c.avx512vnni = c.avx512f && c.avx2_fma && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#if defined(__GNUC__) && __GNUC__ >= 12
    c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
    c.amx_bf16 = __builtin_cpu_supports("amx-bf16");
    c.amx_int8 = __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("avx512vbmi") && c.avx512vnni;
#endif
#endif
    return c;
  }();
  return f;
}

// The OS grants this process the AMX tile state (Linux >= 5.16 asks each process to request
// it, arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), before its first tile
// instruction); asked once, false off Linux/x86-64 or where refused.
inline bool amx_tiles_permitted() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// The 64-byte operand of ldtilecfg (palette 1): per tile register its rows and bytes per row
// (csrc/quant_amx.cpp, csrc/quant_amx_int.cpp).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A kernel's AVX2 + FMA path is on: the CPU has it and the kernel's test hook (force_portable,
// set through its _<kernel>_force_portable binding) has not forced the portable code.
inline bool avx2_enabled(const std::atomic<bool>& force_portable) {
  return cpu_features().avx2_fma && !force_portable.load();
}

}  // namespace tokenserve
