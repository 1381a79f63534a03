// Each kernel file registers its Python bindings here, so csrc/*.cpp files are
// independent: module.cpp calls every registered function once at import.
#pragma once
#include <torch/extension.h>

#include <vector>

namespace tokenserve {

using RegisterFn = void (*)(pybind11::module_&);

// The list of registration functions (a function-local static: no init-order issues).
inline std::vector<RegisterFn>& registry() {
  static std::vector<RegisterFn> fns;
  return fns;
}

struct Registrar {
  explicit Registrar(RegisterFn fn) { registry().push_back(fn); }
};

// Bindings of kernels that run long enough to matter (GEMMs, attention, sampling, the
// decoder stack) release the GIL while they run: the forward pass runs on the model
// thread, and holding the GIL there would freeze the server's event loop for the whole
// step (every stream's next chunk, new connections). They touch no Python object.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

}  // namespace tokenserve

// Use once per .cpp file at namespace scope: TOKENSERVE_REGISTER(attention) { m.def(...); }
#define TOKENSERVE_REGISTER(name)                                              \
  static void tokenserve_register_##name(pybind11::module_& m);                \
  static ::tokenserve::Registrar tokenserve_registrar_##name(                  \
      &tokenserve_register_##name);                                            \
  static void tokenserve_register_##name(pybind11::module_& m)
