// tokenserve._C: the C++ kernels (pybind11). Every csrc/*.cpp registers its functions
// through TOKENSERVE_REGISTER (registry.h); this file only builds the module.
#include "cpu_features.h"
#include "registry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tokenserve C++ kernels: paged attention, block-table ops, GEMM, fused sampling";
  m.attr("ABI_VERSION") = 2;
  m.def("cpu_features", [] {
    const auto& f = tokenserve::cpu_features();
    pybind11::dict d;
    d["avx2_fma"] = f.avx2_fma;
    d["avx512f"] = f.avx512f;
    d["avx512bf16"] = f.avx512bf16;
    d["avx512vnni"] = f.avx512vnni;
    d["amx_bf16"] = f.amx_bf16;
    d["amx_int8"] = f.amx_int8;
    return d;
  }, "The CPU features the kernels dispatch on: {avx2_fma, avx512f, avx512bf16, avx512vnni, amx_bf16, amx_int8}.");
  for (auto fn : tokenserve::registry()) fn(m);
}
