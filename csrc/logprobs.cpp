// Logprobs of the raw logits per row (the sampled or target token, its rank, the top
// n) without a [rows, vocab] tensor <-> python/enginecore/model/sampler.py
// logprob_rows_torch (the kernel: cpu_kernels_logprobs_impl.h). Rows are spread over
// torch's OpenMP threads; the GIL is released.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cpu_kernels.h"
#include "row_jobs.h"

namespace py = pybind11;

namespace enginecore {
namespace {

void logprob_rows(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, int dtype,
                  uintptr_t tokens, int n, uintptr_t token_lp, uintptr_t rank,
                  uintptr_t top_ids, uintptr_t top_lp, int num_threads) {
  check_rows(rows, cols, row_stride);
  const DType type = check_dtype(dtype);
  if (n < 0 || n > cols) throw std::invalid_argument("n must be in [0, cols]");
  const auto* t = reinterpret_cast<const int64_t*>(tokens);
  for (int64_t r = 0; r < rows; ++r) {
    if (t[r] < 0 || t[r] >= cols) {
      throw std::invalid_argument("tokens[" + std::to_string(r) + "] is not in [0, cols)");
    }
  }
  const LogprobParams p{type,
                        reinterpret_cast<const void*>(logits),
                        row_stride,
                        cols,
                        t,
                        n,
                        reinterpret_cast<float*>(token_lp),
                        reinterpret_cast<int64_t*>(rank),
                        reinterpret_cast<int64_t*>(top_ids),
                        reinterpret_cast<float*>(top_lp)};
  run_rows(cpu_kernels().logprobs, p, rows, cols, num_threads);
}

}  // namespace

void bind_logprobs(py::module_& m) {
  m.def("logprob_rows", &logprob_rows, py::arg("logits"), py::arg("row_stride"), py::arg("rows"),
        py::arg("cols"), py::arg("dtype"), py::arg("tokens"), py::arg("n"), py::arg("token_lp"),
        py::arg("rank"), py::arg("top_ids"), py::arg("top_lp"), py::arg("num_threads"),
        "Per row r of logits (float32, or bf16 for dtype 1), lp_j = (x_j - max) - "
        "log(sum exp(x - max)) in float64 rounded to float32 (NaN where the max is not "
        "finite): token_lp[r] = lp of tokens[r] (int64, in [0, cols)), rank[r] = 1 + the "
        "count of x_j > x_tokens[r], top_ids[r, :n] / top_lp[r, :n] the n first in (x desc, "
        "index asc) order (NaN above +inf, -0 below +0).");
}

}  // namespace enginecore
