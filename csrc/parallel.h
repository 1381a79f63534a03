// Work sharing for the CPU kernels: the work units of a call split into one contiguous
// range per task, and a task that finishes its own range takes units from the others'
// ranges (each range has its own cursor).
//
// Why: at::parallel_for hands each thread a fixed share, so the call ends when the slowest
// thread does. On a shared 2-vCPU host one thread is often slower for a while (descheduled
// by the server's event loop or another tenant, or waiting on DRAM) while the other spins
// at the barrier. With the ranges the fast thread finishes the slow one's units. Each task
// still starts on one long sequential run of units (its weight rows stream in order, the
// prefetchers follow). (Most of the OpenMP worker's spinning in a decode step, ~14 % of its
// samples, is while the master runs the step's Python: no split of a kernel recovers that.)
//
// Which thread computes a unit never changes that unit's arithmetic, so every result is
// bit-identical whatever the split; the kernels' tests compare across thread counts.
//
// Measured (Sapphire Rapids, 2 threads, the AMX-INT8 GEMM with fixed shares vs these
// ranges): `bench.profile_step --batch 64 --context 85` alternated three times while the
// host was noisy, 67.2 / 68.9 / 70.6 vs 64.7 / 62.5 / 65.3 ms a step; in a calmer hour no
// difference (six alternations, 55-61 ms both). Served, 64 streams, five alternations of
// the whole change: 839 vs 843 tok/s (noise), mean TTFT 663 vs 631 ms.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace tokenserve {

class StealingRanges {
 public:
  // units >= 0 work units over ntasks >= 1 tasks: task t owns [t * units / ntasks,
  // (t + 1) * units / ntasks).
  StealingRanges(int64_t units, int64_t ntasks) : n_(std::max<int64_t>(1, ntasks)), r_(new Range[size_t(n_)]) {
    for (int64_t t = 0; t < n_; ++t) {
      r_[t].next.store(t * units / n_, std::memory_order_relaxed);
      r_[t].end = (t + 1) * units / n_;
    }
  }

  int64_t ntasks() const { return n_; }

  // The next unit for task t, its own range first and then the others' in turn; -1 when
  // every range is done. k: the task's place in that turn (start at 0, updated here).
  // end (optional): the end of the range the unit came from (u + 1 < *end: the unit most
  // likely next on this task, e.g. to prefetch its data).
  int64_t claim(int64_t t, int64_t& k, int64_t* end = nullptr) {
    for (; k < n_; ++k) {
      Range& r = r_[(t + k) % n_];
      const int64_t u = r.next.fetch_add(1, std::memory_order_relaxed);
      if (u < r.end) {
        if (end) *end = r.end;
        return u;
      }
    }
    return -1;
  }

 private:
  struct alignas(64) Range {
    std::atomic<int64_t> next;
    int64_t end;
  };
  int64_t n_;
  std::unique_ptr<Range[]> r_;
};

// task(t, ranges) for t in [0, ntasks) in one parallel region over the units' ranges (ntasks
// clamped to [1, units]): for a task that claims its units itself (e.g. to set up per-thread
// state once, or to prefetch the next unit's data).
template <class Task>
void parallel_tasks(int64_t units, int64_t ntasks, Task&& task) {
  StealingRanges ranges(units, std::max<int64_t>(1, std::min(ntasks, units)));
  at::parallel_for(0, ranges.ntasks(), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) task(t, ranges);
  });
}

// fn(u) for every u in [0, units) on up to ntasks threads (serial for one task).
template <class Fn>
void parallel_units(int64_t units, int64_t ntasks, Fn&& fn) {
  if (std::min(ntasks, units) <= 1) {
    for (int64_t u = 0; u < units; ++u) fn(u);
    return;
  }
  parallel_tasks(units, ntasks, [&](int64_t t, StealingRanges& ranges) {
    for (int64_t k = 0, u; (u = ranges.claim(t, k)) >= 0;) fn(u);
  });
}

// at::parallel_for's contract with the ranges above: fn(begin, end) over [0, n) in pieces
// of `grain` items (the last one shorter), on up to all threads; serial when n <= grain.
template <class Fn>
void parallel_for_stealing(int64_t n, int64_t grain, Fn&& fn) {
  grain = std::max<int64_t>(1, grain);
  const int64_t pieces = (n + grain - 1) / grain;
  parallel_units(pieces, at::get_num_threads(),
                 [&](int64_t p) { fn(p * grain, std::min(n, (p + 1) * grain)); });
}

}  // namespace tokenserve
