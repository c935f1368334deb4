// Greedy sampling straight from the LM head's logits in the model dtype <->
// python/enginecore/model/sampler.py greedy_argmax_py (torch.argmax). Used when
// every row of a step is plain greedy (no logprobs, penalties, bias, masks), so
// the step skips the fp32 copy of [rows, vocab] logits and the separate pass
// over it. Rows are spread over torch's OpenMP threads; the GIL is released.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "cpu_kernels.h"
#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Below this many logits in all, one thread: waking the team costs more.
constexpr int64_t kParallelMinLogits = 1 << 17;

struct ArgmaxJob {
  const ArgmaxParams* p;
  int64_t rows;
};

void run_row(void* ctx, int64_t i) {
  const auto* job = static_cast<const ArgmaxJob*>(ctx);
  cpu_kernels().argmax(*job->p, i, i + 1);
}

void greedy_argmax(uintptr_t logits, int64_t row_stride, int64_t rows, int cols, uintptr_t out,
                   int dtype, int num_threads) {
  const DType type = check_dtype(dtype);
  if (rows < 0 || cols <= 0) throw std::invalid_argument("need rows >= 0 and cols > 0");
  ArgmaxParams p{type, reinterpret_cast<const void*>(logits), row_stride,
                 cols, reinterpret_cast<int64_t*>(out)};
  ArgmaxJob job{&p, rows};
  py::gil_scoped_release release;
  parallel_for(rows, rows * cols < kParallelMinLogits ? 1 : num_threads, run_row, &job);
}

}  // namespace

void bind_greedy_sampler(py::module_& m) {
  m.def("greedy_argmax", &greedy_argmax, py::arg("logits"), py::arg("row_stride"),
        py::arg("rows"), py::arg("cols"), py::arg("out"), py::arg("dtype"),
        py::arg("num_threads"),
        "out[r] = the first index of the maximum of logits row r (a NaN counts as the "
        "maximum), as torch.argmax; int64 out.");
}

}  // namespace enginecore
