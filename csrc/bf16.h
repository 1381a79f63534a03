// bf16 <-> fp32 scalar conversions shared by the kernels, bit-exact with c10::BFloat16:
// bf16 is the top half of an fp32; fp32 -> bf16 rounds to nearest even, NaN -> 0x7FC0.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace tokenserve {

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// One element of a float or at::BFloat16 buffer as fp32, and back (rounded once).
inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) {
  return bf16_to_f32(reinterpret_cast<const uint16_t&>(*p));
}
inline void store1(float* p, float v) { *p = v; }
inline void store1(at::BFloat16* p, float v) {
  reinterpret_cast<uint16_t&>(*p) = f32_to_bf16(v);
}

}  // namespace tokenserve
