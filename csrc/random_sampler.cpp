// Random sampling from float32 or bf16 logits, one key (and optionally one
// temperature) per row <->
// python/enginecore/model/sampler.py sample_rows_torch (the kernel, the exponential
// race on hashed Exp(1) variables: cpu_kernels_sample_impl.h), and top-p before it
// <-> sampler.py top_p_rows_torch. Rows are spread over torch's OpenMP threads; the
// GIL is released.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"
#include "row_jobs.h"

namespace py = pybind11;

namespace enginecore {
namespace {

void sample_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, int dtype,
                 uintptr_t temperature, uintptr_t keys, uintptr_t out, int num_threads) {
  check_rows(rows, cols, row_stride);
  const DType type = check_dtype(dtype);
  const auto* t = reinterpret_cast<const float*>(temperature);
  for (int64_t r = 0; t != nullptr && r < rows; ++r) {
    if (!(t[r] > 0.0f && t[r] < __builtin_inff())) {
      throw std::invalid_argument("temperature[" + std::to_string(r) +
                                  "] is not a positive finite number");
    }
  }
  const SampleParams p{type, reinterpret_cast<const void*>(logits),
                       row_stride, cols, t, reinterpret_cast<const int64_t*>(keys),
                       reinterpret_cast<int64_t*>(out)};
  run_rows(cpu_kernels().sample, p, rows, cols, num_threads);
}

void top_p_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, uintptr_t top_p,
                int num_threads) {
  check_rows(rows, cols, row_stride);
  const auto* p = reinterpret_cast<const double*>(top_p);
  for (int64_t r = 0; r < rows; ++r) {
    if (!(p[r] > 0.0 && p[r] <= 1.0)) {
      throw std::invalid_argument("top_p[" + std::to_string(r) + "] is not in (0, 1]");
    }
  }
  const TopPParams params{reinterpret_cast<float*>(logits), row_stride, cols, p};
  run_rows(cpu_kernels().top_p, params, rows, cols, num_threads);
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
        py::arg("cols"), py::arg("dtype"), py::arg("temperature"), py::arg("keys"),
        py::arg("out"), py::arg("num_threads"),
        "out[r] (int64) = a draw from softmax(x_r; -inf never drawn), x_r = logits row r "
        "(float32, or bf16 for dtype 1) in float32, divided by temperature[r] (float32; "
        "address 0: none, each > 0 and finite): the "
        "exponential race argmax_j exp(x_j - max) / E_j, E_j = -log(u_j), u_j hashed from "
        "(keys[r], j) (sampler.race_uniforms); a row whose max is NaN or infinite gives "
        "its argmax.");
}

}  // namespace enginecore
