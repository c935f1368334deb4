// Random sampling from float32 logits, one key per row <->
// python/enginecore/model/sampler.py sample_rows_torch (the kernel, the exponential
// race on hashed Exp(1) variables: cpu_kernels_sample_impl.h). Rows are spread over
// torch's OpenMP threads; the GIL is released.
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

void sample_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, uintptr_t keys,
                 uintptr_t out, int num_threads) {
  if (rows < 0 || cols <= 0) throw std::invalid_argument("need rows >= 0 and cols > 0");
  if (rows > 1 && row_stride < cols) {
    throw std::invalid_argument("row_stride is shorter than a row");
  }
  SampleParams p{reinterpret_cast<const float*>(logits), row_stride, cols,
                 reinterpret_cast<const int64_t*>(keys), reinterpret_cast<int64_t*>(out)};
  py::gil_scoped_release release;
  parallel_for(rows, rows * cols < kParallelMinLogits ? 1 : num_threads, run_row, &p);
}

}  // namespace

void bind_random_sampler(py::module_& m) {
  m.def("sample_rows", &sample_rows, py::arg("logits"), py::arg("row_stride"), py::arg("rows"),
        py::arg("cols"), py::arg("keys"), py::arg("out"), py::arg("num_threads"),
        "out[r] (int64) = a draw from softmax(float32 logits row r; -inf never drawn): the "
        "exponential race argmax_j exp(x_j - max) / E_j, E_j = -log(u_j), u_j hashed from "
        "(keys[r], j) (sampler.race_uniforms); a row whose max is NaN or infinite gives "
        "its argmax.");
}

}  // namespace enginecore
