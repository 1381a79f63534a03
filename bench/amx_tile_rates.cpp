// What one Intel AMX-INT8 tile op costs on this CPU: tdpbsud at depths 16 / 32 / 64 bytes
// with four, two and one accumulation chains, tileloadd and tilestored of 1 KB from L1,
// and the core clock from a chain of dependent adds (bench/README.md "Q6_K's scales in the
// AMX tiles"). Standalone, not part of the extension:
//   g++ -O2 -mamx-tile -mamx-int8 -o /tmp/amx_tile_rates bench/amx_tile_rates.cpp
//   for k in 16 32 64; do /tmp/amx_tile_rates $k; done
// Linux only (asks the kernel for the AMX tile state, arch_prctl ARCH_REQ_XCOMP_PERM).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double ns_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureTileData) != 0) {
    std::fprintf(stderr, "no AMX tile state from the kernel\n");
    return 1;
  }
  const int depth = argc > 1 ? std::atoi(argv[1]) : 64;  // bytes of A per row (K)
  if (depth % 4 || depth < 4 || depth > 64) return 2;
  TileConfig c;  // 0-3: C 16 x 16 int32; 4, 7: A 16 x depth; 5, 6: B depth / 4 x 64
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  c.colsb[4] = c.colsb[7] = uint16_t(depth);
  c.rows[5] = c.rows[6] = uint8_t(depth / 4);
  _tile_loadconfig(&c);
  alignas(64) static int8_t buf[4 * 1024] = {};
  _tile_loadd(4, buf, 64);
  _tile_loadd(7, buf, 64);
  _tile_loadd(5, buf, 64);
  _tile_loadd(6, buf, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr long kIters = 2000000;
  const char* names[3] = {"four chains", "two chains", "one chain"};
  for (int chains = 0; chains < 3; ++chains) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < kIters; ++i) {
      if (chains == 0) {
        _tile_dpbsud(0, 4, 5); _tile_dpbsud(1, 4, 6); _tile_dpbsud(2, 7, 5); _tile_dpbsud(3, 7, 6);
      } else if (chains == 1) {
        _tile_dpbsud(0, 4, 5); _tile_dpbsud(1, 4, 6); _tile_dpbsud(0, 7, 5); _tile_dpbsud(1, 7, 6);
      } else {
        _tile_dpbsud(0, 4, 5); _tile_dpbsud(0, 4, 6); _tile_dpbsud(0, 7, 5); _tile_dpbsud(0, 7, 6);
      }
    }
    std::printf("depth %d, %s: %.2f ns per tdpbsud\n", depth, names[chains], ns_since(t0) / (4.0 * kIters));
  }
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) {
    _tile_loadd(5, buf, 64); _tile_loadd(6, buf + 1024, 64); _tile_loadd(4, buf + 2048, 64); _tile_loadd(7, buf + 3072, 64);
  }
  std::printf("tileloadd: %.2f ns each\n", ns_since(t0) / (4.0 * kIters));
  t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIters; ++i) {
    _tile_stored(0, buf, 64); _tile_stored(1, buf + 1024, 64); _tile_stored(2, buf + 2048, 64); _tile_stored(3, buf + 3072, 64);
  }
  std::printf("tilestored (1 KB): %.2f ns each\n", ns_since(t0) / (4.0 * kIters));
  constexpr long kAdds = 400000000;
  t0 = std::chrono::steady_clock::now();
  uint64_t x = 1;
  for (long i = 0; i < kAdds; ++i) {
    x += uint64_t(i);
    asm volatile("" : "+r"(x));  // one dependent add per iteration: ~1 cycle
  }
  const double ns = ns_since(t0);
  std::printf("dependent add: %.3f ns -> ~%.2f GHz\n", ns / kAdds, kAdds / ns);
  _tile_release();
  return 0;
}
