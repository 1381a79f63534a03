// Test hook of csrc/parallel.h's work sharing (no kernel): which task ran each unit.
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "parallel.h"
#include "registry.h"

namespace tokenserve {
namespace {

// For units over ntasks tasks (parallel_tasks clamps ntasks to [1, units]): owner[u] = the task that ran unit u (-1: never ran; a unit
// run twice is reported as -2). Task 0 sleeps slow_us microseconds per unit (a descheduled
// thread), so with two threads the other task should run some of task 0's range.
std::vector<int64_t> parallel_units_owners(int64_t units, int64_t ntasks, int64_t slow_us) {
  TORCH_CHECK(units >= 0 && ntasks >= 1 && slow_us >= 0, "parallel_units_owners: bad arguments");
  std::vector<std::atomic<int64_t>> owner(static_cast<size_t>(units));
  for (auto& o : owner) o.store(-1);
  parallel_tasks(units, ntasks, [&](int64_t t, StealingRanges& ranges) {
    for (int64_t k = 0, u; (u = ranges.claim(t, k)) >= 0;) {
      if (t == 0 && slow_us) std::this_thread::sleep_for(std::chrono::microseconds(slow_us));
      int64_t expect = -1;
      if (!owner[size_t(u)].compare_exchange_strong(expect, t)) owner[size_t(u)].store(-2);
    }
  });
  std::vector<int64_t> out;
  for (auto& o : owner) out.push_back(o.load());
  return out;
}

}  // namespace
}  // namespace tokenserve

TOKENSERVE_REGISTER(parallel) {
  m.def("_parallel_units_owners", &tokenserve::parallel_units_owners,
        tokenserve::ReleaseGil(),
        "_parallel_units_owners(units, ntasks, slow_us) -> list[int]: the task that ran each "
        "work unit of csrc/parallel.h's StealingRanges (test hook; task 0 sleeps slow_us "
        "per unit).",
        pybind11::arg("units"), pybind11::arg("ntasks"), pybind11::arg("slow_us"));
}
