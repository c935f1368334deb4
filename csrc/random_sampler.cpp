// Random sampling from float32 logits, one key per row <->
// python/enginecore/model/sampler.py sample_rows_torch (the kernel, the exponential
// race on hashed Exp(1) variables: cpu_kernels_sample_impl.h), and top-p before it
// <-> sampler.py top_p_rows_torch. Rows are spread over torch's OpenMP threads; the
// GIL is released.
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"
#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Below this many logits in all, one thread: waking the team costs more.
constexpr int64_t kParallelMinLogits = 1 << 15;

// A row's scratch (a vocabulary's worth per thread) may fail to allocate inside the
// team, where nothing may throw: the failure is noted and raised after the team joins.
struct Job {
  const void* params;
  std::atomic<bool> failed{false};
};

void run_row(void* ctx, int64_t i) {
  auto* job = static_cast<Job*>(ctx);
  try {
    cpu_kernels().sample(*static_cast<const SampleParams*>(job->params), i, i + 1);
  } catch (...) {
    job->failed.store(true, std::memory_order_relaxed);
  }
}

void raise_if_failed(const Job& job) {
  if (job.failed.load()) throw std::bad_alloc();  // MemoryError
}

void sample_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, uintptr_t keys,
                 uintptr_t out, int num_threads) {
  if (rows < 0 || cols <= 0) throw std::invalid_argument("need rows >= 0 and cols > 0");
  if (rows > 1 && row_stride < cols) {
    throw std::invalid_argument("row_stride is shorter than a row");
  }
  SampleParams p{reinterpret_cast<const float*>(logits), row_stride, cols,
                 reinterpret_cast<const int64_t*>(keys), reinterpret_cast<int64_t*>(out)};
  Job job{&p};
  {
    py::gil_scoped_release release;
    parallel_for(rows, rows * cols < kParallelMinLogits ? 1 : num_threads, run_row, &job);
  }
  raise_if_failed(job);
}

void run_top_p_row(void* ctx, int64_t i) {
  auto* job = static_cast<Job*>(ctx);
  try {
    cpu_kernels().top_p(*static_cast<const TopPParams*>(job->params), i, i + 1);
  } catch (...) {
    job->failed.store(true, std::memory_order_relaxed);
  }
}

void top_p_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, uintptr_t top_p,
                int num_threads) {
  if (rows < 0 || cols <= 0) throw std::invalid_argument("need rows >= 0 and cols > 0");
  if (rows > 1 && row_stride < cols) {
    throw std::invalid_argument("row_stride is shorter than a row");
  }
  const auto* p = reinterpret_cast<const double*>(top_p);
  for (int64_t r = 0; r < rows; ++r) {
    if (!(p[r] > 0.0 && p[r] <= 1.0)) {
      throw std::invalid_argument("top_p[" + std::to_string(r) + "] is not in (0, 1]");
    }
  }
  TopPParams params{reinterpret_cast<float*>(logits), row_stride, cols, p};
  Job job{&params};
  {
    py::gil_scoped_release release;
    parallel_for(rows, rows * cols < kParallelMinLogits ? 1 : num_threads, run_top_p_row, &job);
  }
  raise_if_failed(job);
}

}  // namespace

void bind_random_sampler(py::module_& m) {
  m.def("top_p_rows", &top_p_rows, py::arg("logits"), py::arg("row_stride"), py::arg("rows"),
        py::arg("cols"), py::arg("top_p"), py::arg("num_threads"),
        "In place on float32 logits: rank row r by (logit desc, index asc) and set to -inf "
        "every token whose more likely tokens already weigh >= top_p[r] (float64, in (0, 1]) "
        "of the row (weights exp(logit - max), float64); a row whose max is NaN or infinite "
        "is left alone.");
  m.def("sample_rows", &sample_rows, py::arg("logits"), py::arg("row_stride"), py::arg("rows"),
        py::arg("cols"), py::arg("keys"), py::arg("out"), py::arg("num_threads"),
        "out[r] (int64) = a draw from softmax(float32 logits row r; -inf never drawn): the "
        "exponential race argmax_j exp(x_j - max) / E_j, E_j = -log(u_j), u_j hashed from "
        "(keys[r], j) (sampler.race_uniforms); a row whose max is NaN or infinite gives "
        "its argmax.");
}

}  // namespace enginecore
