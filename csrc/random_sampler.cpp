// Random sampling from float32 logits, one uniform per row <->
// python/enginecore/model/sampler.py sample_rows_torch (the kernel:
// cpu_kernels_sample_impl.h). Rows are spread over torch's OpenMP threads; the GIL
// is released.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "cpu_kernels.h"
#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Below this many logits in all, one thread: waking the team costs more.
constexpr int64_t kParallelMinLogits = 1 << 15;

void run_row(void* ctx, int64_t i) {
  cpu_kernels().sample(*static_cast<const SampleParams*>(ctx), i, i + 1);
}

void sample_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, uintptr_t u,
                 uintptr_t out, int num_threads) {
  if (rows < 0 || cols <= 0) throw std::invalid_argument("need rows >= 0 and cols > 0");
  if (rows > 1 && row_stride < cols) {
    throw std::invalid_argument("row_stride is shorter than a row");
  }
  const auto* draws = reinterpret_cast<const double*>(u);
  for (int64_t r = 0; r < rows; ++r) {
    if (!(draws[r] >= 0.0 && draws[r] < 1.0)) {
      throw std::invalid_argument("u[" + std::to_string(r) + "] is not in [0, 1)");
    }
  }
  SampleParams p{reinterpret_cast<const float*>(logits), row_stride, cols, draws,
                 reinterpret_cast<int64_t*>(out)};
  py::gil_scoped_release release;
  parallel_for(rows, rows * cols < kParallelMinLogits ? 1 : num_threads, run_row, &p);
}

}  // namespace

void bind_random_sampler(py::module_& m) {
  m.def("sample_rows", &sample_rows, py::arg("logits"), py::arg("row_stride"), py::arg("rows"),
        py::arg("cols"), py::arg("u"), py::arg("out"), py::arg("num_threads"),
        "out[r] (int64) = a draw from softmax(logits row r) (float32 logits, -inf: never "
        "drawn) by the uniform u[r] (float64, in [0, 1)): the first token whose running sum "
        "of exp(logit - max) passes u[r] times the sum; a row whose max is NaN or infinite "
        "gives its argmax.");
}

}  // namespace enginecore
