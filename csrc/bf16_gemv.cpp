// bf16_gemv <-> python/enginecore/model/kernel_twins.py bf16_gemv_py:
// y = x W^T (+ b) for 1-4 rows of bfloat16 x against the plain [N][K] bfloat16
// weight, on CPUs with AVX512_BF16 (Zen 4+, Cooper Lake, Sapphire Rapids+).
//
// Why: a decode step of a few sequences reads every weight once and does two
// flops per weight read: it runs at the speed weights stream from memory. oneDNN's
// packed bf16 GEMM (model/linear.py "onednn") streamed them at 18.5 GB/s on the
// 2-core AVX-512 EPYC, 40 % of what the cores read (docs/benchmarks.md). Here each
// weight row is read once, front to back (consecutive rows are consecutive in
// memory: one stream per thread), 32 weights per VDPBF16PS against the resident x,
// and 16 rows' dot products come out of one transpose-and-add tree.
//
// Numerics: VDPBF16PS multiplies bf16 pairs exactly and adds each pair into the
// float32 lane with one rounding (denormal inputs and results flushed to zero, as
// the instruction defines); the 16 lanes are summed by a fixed tree, the bias added
// in float32, one rounding to bfloat16 (nearest even). The same bits for any
// thread count. The torch twin is a float32 matmul of the same bf16 values: equal
// within float32 rounding before the one bf16 rounding.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>
#define ENGINECORE_GEMV 1
#endif

#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Rows of x the kernel takes (a decode step of up to this many sequences).
constexpr int kMaxRows = 4;
// Weight rows per work item (4 groups of 16: about 70 KiB of a 576-wide weight).
constexpr int64_t kRowsPerItem = 64;
constexpr int kPrefetchBytes = 1024;

struct GemvJob {
  const uint16_t* x;
  int64_t x_stride;
  int rows;
  const uint16_t* w;  // [N][K]
  const uint16_t* bias;
  uint16_t* out;
  int64_t out_stride, K, N;
};

#ifdef ENGINECORE_GEMV
#define GEMV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

#include "hsum16_avx512.h"

template <int M>
GEMV_TARGET void gemv_item(const GemvJob& j, int64_t item) {
  const int64_t K = j.K;
  const int64_t full = K / 32, tail = K % 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((1ULL << tail) - 1);
  const int64_t n_end = (item + 1) * kRowsPerItem < j.N ? (item + 1) * kRowsPerItem : j.N;
  for (int64_t n0 = item * kRowsPerItem; n0 < n_end; n0 += 16) {
    const int nr = n_end - n0 < 16 ? static_cast<int>(n_end - n0) : 16;
    __m512 P[M][16];
    for (int jj = 0; jj < 16; ++jj) {
      __m512 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
      if (jj < nr) {
        const uint16_t* wr = j.w + (n0 + jj) * K;
        for (int64_t c = 0; c < full; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(wr + 32 * c) + kPrefetchBytes, _MM_HINT_T0);
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + 32 * c);
          for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(j.x + m * j.x_stride + 32 * c);
            acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
          }
        }
        if (tail) {
          const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, wr + 32 * full);
          for (int m = 0; m < M; ++m) {
            const __m512bh xv =
                (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, j.x + m * j.x_stride + 32 * full);
            acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
          }
        }
      }
      for (int m = 0; m < M; ++m) P[m][jj] = acc[m];
    }
    const __mmask16 out_mask = static_cast<__mmask16>((1u << nr) - 1);
    __m512 b = _mm512_setzero_ps();
    if (j.bias != nullptr) {
      const __m256i bb = _mm256_maskz_loadu_epi16(out_mask, j.bias + n0);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 y = _mm512_add_ps(hsum16(P[m]), b);
      const __m256i yb = (__m256i)_mm512_cvtneps_pbh(y);
      _mm256_mask_storeu_epi16(j.out + m * j.out_stride + n0, out_mask, yb);
    }
  }
}

GEMV_TARGET void run_item(void* ctx, int64_t item) {
  const auto& j = *static_cast<const GemvJob*>(ctx);
  switch (j.rows) {
    case 1: return gemv_item<1>(j, item);
    case 2: return gemv_item<2>(j, item);
    case 3: return gemv_item<3>(j, item);
    default: return gemv_item<4>(j, item);
  }
}
#endif

bool gemv_supported() {
#ifdef ENGINECORE_GEMV
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
#else
  return false;
#endif
}

void bf16_gemv(uintptr_t x, int64_t x_stride, int64_t rows, uintptr_t weight, uintptr_t bias,
               uintptr_t out, int64_t out_stride, int64_t in_features, int64_t out_features,
               int num_threads) {
  if (!gemv_supported()) throw std::runtime_error("bf16_gemv: this CPU has no AVX512_BF16");
  if (rows < 1 || rows > kMaxRows || in_features <= 0 || out_features <= 0) {
    throw std::invalid_argument("bf16_gemv: 1 <= rows <= 4, in_features > 0, out_features > 0");
  }
  if (rows > 1 && (x_stride < in_features || out_stride < out_features)) {
    throw std::invalid_argument("bf16_gemv: a row stride is shorter than its row");
  }
  if (x == 0 || weight == 0 || out == 0) throw std::invalid_argument("bf16_gemv: null buffer");
#ifdef ENGINECORE_GEMV
  GemvJob job{reinterpret_cast<const uint16_t*>(x), x_stride, static_cast<int>(rows),
              reinterpret_cast<const uint16_t*>(weight), reinterpret_cast<const uint16_t*>(bias),
              reinterpret_cast<uint16_t*>(out), out_stride, in_features, out_features};
  const int64_t items = (out_features + kRowsPerItem - 1) / kRowsPerItem;
  py::gil_scoped_release release;
  parallel_for(items, num_threads > 1 ? num_threads : 1, run_item, &job);
#endif
}

}  // namespace

bool bf16_gemv_available() { return gemv_supported(); }

void bind_bf16_gemv(py::module_& m) {
  m.def("bf16_gemv", &bf16_gemv, py::arg("x"), py::arg("x_stride"), py::arg("rows"),
        py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("out_stride"),
        py::arg("in_features"), py::arg("out_features"), py::arg("num_threads"),
        "out[rows, out_features] = x W^T (+ bias) for 1-4 rows, bfloat16 in and out, the "
        "plain [out_features][in_features] weight read once (AVX512_BF16; bias 0: none).");
  m.def("bf16_gemv_available", &bf16_gemv_available,
        "Whether this CPU runs bf16_gemv (AVX512_BF16).");
}

}  // namespace enginecore
