// Fused element-wise model ops <-> their torch twins: rms_norm (and the
// residual add before it) in python/enginecore/model/fused_ops.py, silu_and_mul
// there too, rope in python/enginecore/model/rope.py. Each replaces several
// small torch ops (one dispatch, one pass over memory), which is what a
// batch-1 step is made of. Rows are split over torch's OpenMP threads when
// there are enough of them; the GIL is released.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "cpu_kernels.h"
#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Elements per parallel chunk: smaller pieces cost more to hand out than to do.
constexpr int64_t kChunkElems = 1 << 15;

template <typename Params>
struct RowJob {
  const Params* p;
  void (*kernel)(const Params&, int64_t, int64_t);
  int64_t rows, rows_per_chunk;
};

template <typename Params>
void run_rows(void* ctx, int64_t i) {
  const auto* job = static_cast<const RowJob<Params>*>(ctx);
  const int64_t r0 = i * job->rows_per_chunk;
  const int64_t r1 = r0 + job->rows_per_chunk < job->rows ? r0 + job->rows_per_chunk : job->rows;
  job->kernel(*job->p, r0, r1);
}

template <typename Params>
void split_rows(const Params& p, void (*kernel)(const Params&, int64_t, int64_t), int64_t rows,
                int64_t row_elems, int num_threads) {
  if (rows <= 0) return;
  int64_t per = kChunkElems / (row_elems > 0 ? row_elems : 1);
  if (per < 1) per = 1;
  const int64_t chunks = (rows + per - 1) / per;
  RowJob<Params> job{&p, kernel, rows, per};
  py::gil_scoped_release release;
  parallel_for(chunks, num_threads, run_rows<Params>, &job);
}

void rms_norm(uintptr_t x, int64_t x_stride, uintptr_t delta, int64_t delta_stride,
              uintptr_t weight, uintptr_t out, int64_t out_stride, int64_t rows, int hidden,
              double eps, int dtype, int num_threads) {
  RmsNormParams p{check_dtype(dtype), reinterpret_cast<void*>(x), x_stride,
                  reinterpret_cast<const void*>(delta), delta_stride,
                  reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(out),
                  out_stride, hidden, eps};
  split_rows(p, cpu_kernels().rms_norm, rows, hidden, num_threads);
}

void rope(uintptr_t x, int64_t x_st, int64_t x_sh, uintptr_t positions, uintptr_t cos,
          uintptr_t sin, int64_t table_stride, int64_t tokens, int num_heads, int rotary_dim,
          int dtype, int num_threads) {
  if (rotary_dim <= 0 || rotary_dim % 2 != 0) throw std::invalid_argument("rotary_dim must be even");
  RopeParams p{check_dtype(dtype), reinterpret_cast<void*>(x), x_st, x_sh,
               reinterpret_cast<const int64_t*>(positions), reinterpret_cast<const void*>(cos),
               reinterpret_cast<const void*>(sin), table_stride, num_heads, rotary_dim};
  split_rows(p, cpu_kernels().rope, tokens, static_cast<int64_t>(num_heads) * rotary_dim,
             num_threads);
}

void silu_and_mul(uintptr_t x, int64_t x_stride, uintptr_t out, int64_t out_stride, int64_t rows,
                  int width, int dtype, int num_threads) {
  SiluMulParams p{check_dtype(dtype), reinterpret_cast<const void*>(x), x_stride,
                  reinterpret_cast<void*>(out), out_stride, width};
  split_rows(p, cpu_kernels().silu_and_mul, rows, 2LL * width, num_threads);
}

}  // namespace

void bind_fused_ops(py::module_& m) {
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("x_stride"), py::arg("delta"),
        py::arg("delta_stride"), py::arg("weight"), py::arg("out"), py::arg("out_stride"),
        py::arg("rows"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"),
        py::arg("num_threads"),
        "out = weight * rmsnorm(x) per row; with delta != 0, x += delta first (in place).");
  m.def("rope", &rope, py::arg("x"), py::arg("x_st"), py::arg("x_sh"), py::arg("positions"),
        py::arg("cos"), py::arg("sin"), py::arg("table_stride"), py::arg("tokens"),
        py::arg("num_heads"), py::arg("rotary_dim"), py::arg("dtype"), py::arg("num_threads"),
        "Rotate-half RoPE in place on [tokens, heads, head_dim] at int64 positions.");
  m.def("silu_and_mul", &silu_and_mul, py::arg("x"), py::arg("x_stride"), py::arg("out"),
        py::arg("out_stride"), py::arg("rows"), py::arg("width"), py::arg("dtype"),
        py::arg("num_threads"), "out = silu(gate) * up for rows of [gate | up].");
}

}  // namespace enginecore
