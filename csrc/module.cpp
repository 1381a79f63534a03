// tokenserve._C: C++ kernels (fused sampling, block-table ops) arrive in a later issue.
// For now the module carries only its ABI version, so the build path is exercised.
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "tokenserve C++ kernels";
  m.attr("ABI_VERSION") = 1;
}
