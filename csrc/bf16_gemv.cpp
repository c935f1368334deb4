// bf16_gemv <-> python/enginecore/model/kernel_twins.py bf16_gemv_py:
// y = x W^T (+ b) for 1-4 rows (model/linear.py sends 1-2) of bfloat16 x against the plain [N][K] bfloat16
// weight, on CPUs with AVX512_BF16 (Zen 4+, Cooper Lake, Sapphire Rapids+).
//
// Why: a decode step of a few sequences reads every weight once and does two
// flops per weight read: it runs at the speed weights stream from memory. oneDNN's
// packed bf16 GEMM (model/linear.py "onednn") streamed them at 18.5 GB/s on the
// 2-core AVX-512 EPYC, 40 % of what the cores read (docs/benchmarks.md). Here each
// weight row is read once, front to back (consecutive rows are consecutive in
// memory: one stream per thread), 32 weights per load against the resident x
// (widened to float32 once per call), and 16 rows' dot products come out of one
// transpose-and-add tree.
//
// Numerics, defined so a torch twin replays them bit for bit (model/linear.py
// bf16_gemv_torch): a bf16 x bf16 product is exact in float32, so each weight
// pair's products go into two float32 accumulators per lane by FMA (one
// rounding per add, exactly `acc + product` in torch): lane l of chunk c takes
// elements 32c + 2l (even) and 32c + 2l + 1 (odd), chunks in order; then even +
// odd per lane, the 16 lanes by hsum16's fixed tree, the bias added in float32
// (when there is one), one rounding to bfloat16 (nearest even, as torch).
// VDPBF16PS would be one instruction per 32 weights instead of three, but its
// pair sum rounds in a way the vendors define differently (and it flushes
// denormals): no twin could follow it on every CPU. The same bits for any
// thread count. Two FMAs per 32 weights per row make 3-4 rows FMA-bound (slower
// than oneDNN's VDPBF16PS GEMM there, docs/benchmarks.md): model/linear.py sends
// it 1-2 rows.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

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
  const float* x;  // [rows][chunks][2][16]: each chunk's even then odd elements, zero-padded
  int rows;
  const uint16_t* w;  // [N][K]
  const uint16_t* bias;
  uint16_t* out;
  int64_t out_stride, K, N;
};

#ifdef ENGINECORE_GEMV
#define GEMV_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// hsum16: 16 vectors of 16 floats -> one vector whose lane j is the sum of v[j]'s
// lanes. Pairs of vectors interleaved and added (each 128-bit block then holds partial
// sums of two, then four vectors), then the four blocks folded: 45 instructions for 16
// rows' sums instead of 16 reduction trees. Its pairing is part of the numerics above
// (bf16_gemv_torch replays it).
__attribute__((target("avx512f,avx512dq"), always_inline)) inline __m512 hsum16(const __m512* v) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[i]'s block k: the block-k partial sums of v[4i .. 4i+3].
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// 16 floats to bfloat16, nearest even, NaN as torch's 0x7fc0 (VCVTNEPS2BF16 would
// flush denormals).
GEMV_TARGET inline __m256i round_bf16(__m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}

template <int M>
GEMV_TARGET void gemv_item(const GemvJob& j, int64_t item) {
  const int64_t K = j.K;
  const int64_t full = K / 32, chunks = (K + 31) / 32;
  const __mmask32 tail_mask = static_cast<__mmask32>((1ULL << (K % 32)) - 1);
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t n_end = (item + 1) * kRowsPerItem < j.N ? (item + 1) * kRowsPerItem : j.N;
  for (int64_t n0 = item * kRowsPerItem; n0 < n_end; n0 += 16) {
    const int nr = n_end - n0 < 16 ? static_cast<int>(n_end - n0) : 16;
    __m512 P[M][16];
    for (int jj = 0; jj < 16; ++jj) {
      __m512 even[M], odd[M];
      for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm512_setzero_ps();
      if (jj < nr) {
        const uint16_t* wr = j.w + (n0 + jj) * K;
        for (int64_t c = 0; c < chunks; ++c) {
          _mm_prefetch(reinterpret_cast<const char*>(wr + 32 * c) + kPrefetchBytes, _MM_HINT_T0);
          const __m512i wv = c < full ? _mm512_loadu_si512(wr + 32 * c)
                                      : _mm512_maskz_loadu_epi16(tail_mask, wr + 32 * c);
          // Each 32-bit lane holds elements 2l (low half) and 2l + 1 (high half):
          // as floats, the low one shifted up, the high one with the low bits cleared.
          const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
          const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, odd_mask));
          for (int m = 0; m < M; ++m) {
            const float* xc = j.x + (m * chunks + c) * 32;
            even[m] = _mm512_fmadd_ps(_mm512_load_ps(xc), we, even[m]);
            odd[m] = _mm512_fmadd_ps(_mm512_load_ps(xc + 16), wo, odd[m]);
          }
        }
      }
      for (int m = 0; m < M; ++m) P[m][jj] = _mm512_add_ps(even[m], odd[m]);
    }
    const __mmask16 out_mask = static_cast<__mmask16>((1u << nr) - 1);
    __m512 b = _mm512_setzero_ps();
    if (j.bias != nullptr) {
      const __m256i bb = _mm256_maskz_loadu_epi16(out_mask, j.bias + n0);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bb), 16));
    }
    for (int m = 0; m < M; ++m) {
      __m512 y = hsum16(P[m]);
      if (j.bias != nullptr) y = _mm512_add_ps(y, b);
      _mm256_mask_storeu_epi16(j.out + m * j.out_stride + n0, out_mask, round_bf16(y));
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
  // x widened once, each 32-element chunk as its even then its odd elements
  // (the weights' lane order), zeros past K.
  const int64_t chunks = (in_features + 31) / 32;
  thread_local std::vector<float> buf;
  buf.assign(rows * chunks * 32 + 16, 0.0f);
  float* xs = buf.data() + (16 - reinterpret_cast<uintptr_t>(buf.data()) / 4 % 16) % 16;
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < in_features; ++k) {
      const float v = __builtin_bit_cast(float, static_cast<uint32_t>(xb[m * x_stride + k]) << 16);
      xs[(m * chunks + k / 32) * 32 + (k % 2) * 16 + (k % 32) / 2] = v;
    }
  }
  GemvJob job{xs, static_cast<int>(rows), reinterpret_cast<const uint16_t*>(weight),
              reinterpret_cast<const uint16_t*>(bias), reinterpret_cast<uint16_t*>(out),
              out_stride, in_features, out_features};
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
