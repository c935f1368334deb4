// Row kernels of the sampler (random draws, top-p, logprobs) on torch's OpenMP team:
// the shared shape check and the runner that releases the GIL around the team.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <stdexcept>

#include "cpu_threads.h"

namespace enginecore {

// Below this many logits in all, one thread: waking the team costs more.
constexpr int64_t kRowsParallelMinLogits = 1 << 15;

inline void check_rows(int64_t rows, int cols, int64_t row_stride) {
  if (rows < 0 || cols <= 0) throw std::invalid_argument("need rows >= 0 and cols > 0");
  if (rows > 1 && row_stride < cols) {
    throw std::invalid_argument("row_stride is shorter than a row");
  }
}

// A row's scratch (a vocabulary's worth per thread) may fail to allocate inside the
// team, where nothing may throw: the failure is noted and raised after the team joins.
template <typename Params>
struct RowJob {
  void (*kernel)(const Params&, int64_t, int64_t);
  const Params* params;
  std::atomic<bool> failed{false};
};

template <typename Params>
void run_row(void* ctx, int64_t i) {
  auto* job = static_cast<RowJob<Params>*>(ctx);
  try {
    job->kernel(*job->params, i, i + 1);
  } catch (...) {
    job->failed.store(true, std::memory_order_relaxed);
  }
}

// `kernel` over the rows on torch's team, the GIL released; MemoryError if a row's
// scratch could not be had.
template <typename Params>
void run_rows(void (*kernel)(const Params&, int64_t, int64_t), const Params& params,
              int64_t rows, int cols, int num_threads) {
  RowJob<Params> job{kernel, &params};
  {
    pybind11::gil_scoped_release release;
    parallel_for(rows, rows * cols < kRowsParallelMinLogits ? 1 : num_threads, run_row<Params>,
                 &job);
  }
  if (job.failed.load()) throw std::bad_alloc();
}

}  // namespace enginecore
