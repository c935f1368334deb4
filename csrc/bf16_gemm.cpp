// bf16_linear <-> python/enginecore/model/kernel_twins.py bf16_linear_py:
// y = x W^T (+ b) for bfloat16 x, W, b on a CPU with AVX2 + FMA but no native
// bf16 GEMM (no AVX512_BF16 / AMX, where oneDNN's bf16 reorder refuses to run
// and torch's bf16 matmul measured ~3x slower than its fp32 one beyond a single
// row: docs/benchmarks.md). The weight stays bfloat16 in memory (half the bytes
// of float32, which is what a memory-bound decode step pays for) and is widened
// to float32 in registers; all arithmetic is float32 FMA.
//
// Weight layout ("panels", built once at load by model/linear.py pack_panels):
// [ceil(N/16)][K][16] bfloat16, panel p holding output features 16p..16p+15
// (zero rows past N), so one k step of a panel is 32 contiguous bytes.
// Blocking as a BLIS-style GEMM: a 6 x 16 register tile (12 accumulators),
// K in blocks of 256 (the 8 KiB panel block stays in L1 across the row tiles),
// rows in blocks of 72 (the float32 x block stays in L2 across panels; x is
// widened once, in chunks of at most 16 MiB of floats).
//
// Numerics: every output is one float32 FMA chain over k in order (carried
// exactly through a float32 scratch between K blocks), plus the bias, rounded
// to nearest even; the portable path does the same chain with std::fma, so
// both give the same bits. The torch twin sums in MKL's order: equal within
// float32 rounding before the one bf16 rounding.
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu_threads.h"

namespace py = pybind11;

namespace enginecore {
namespace {

constexpr int kNR = 16;   // output features per panel
constexpr int kMR = 6;    // rows per register tile
constexpr int kKC = 256;  // k per block
constexpr int kMC = 72;   // rows per block (a multiple of kMR)

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even (torch's float -> bfloat16); a NaN becomes the quiet NaN
// 0x7fc0, as c10's scalar conversion (torch's vectorised one may keep other NaN bits).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct GemmJob {
  const float* x;  // [M, K] float32: this chunk's rows of x, widened
  int64_t M, K, N, panels;
  const uint16_t* w;     // [panels][K][16]
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* out;
  int64_t out_stride;
  int64_t panels_per_item, n_items;
};

// c[r][0..16) (+)= sum over k of a[r][k] * w[k][0..16), rows r < mr.
using TileFn = void (*)(const float* a, int64_t lda, const uint16_t* w, int kc, float* c,
                        int64_t ldc, int mr, bool first);

void tile_portable(const float* a, int64_t lda, const uint16_t* w, int kc, float* c, int64_t ldc,
                   int mr, bool first) {
  for (int r = 0; r < mr; ++r) {
    float acc[kNR];
    for (int j = 0; j < kNR; ++j) acc[j] = first ? 0.0f : c[r * ldc + j];
    for (int k = 0; k < kc; ++k) {
      const float av = a[r * lda + k];
      for (int j = 0; j < kNR; ++j) acc[j] = std::fma(av, bf16_to_f32(w[k * kNR + j]), acc[j]);
    }
    for (int j = 0; j < kNR; ++j) c[r * ldc + j] = acc[j];
  }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ENGINECORE_AVX2_GEMM 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")

template <int MR>
inline __attribute__((always_inline)) void tile_avx2_rows(const float* a, int64_t lda,
                                                          const uint16_t* w, int kc, float* c,
                                                          int64_t ldc, bool first) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    acc0[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
    acc1[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
  }
  for (int k = 0; k < kc; ++k) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kNR));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kNR + 8));
    const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
    const __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r * lda + k);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc0[r]);
    _mm256_storeu_ps(c + r * ldc + 8, acc1[r]);
  }
}

void tile_avx2(const float* a, int64_t lda, const uint16_t* w, int kc, float* c, int64_t ldc,
               int mr, bool first) {
  switch (mr) {
    case 6: return tile_avx2_rows<6>(a, lda, w, kc, c, ldc, first);
    case 5: return tile_avx2_rows<5>(a, lda, w, kc, c, ldc, first);
    case 4: return tile_avx2_rows<4>(a, lda, w, kc, c, ldc, first);
    case 3: return tile_avx2_rows<3>(a, lda, w, kc, c, ldc, first);
    case 2: return tile_avx2_rows<2>(a, lda, w, kc, c, ldc, first);
    default: return tile_avx2_rows<1>(a, lda, w, kc, c, ldc, first);
  }
}

#pragma GCC pop_options
#endif

TileFn choose_tile() {
#ifdef ENGINECORE_AVX2_GEMM
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return tile_avx2;
#endif
  return tile_portable;
}

const TileFn& tile_fn() {
  static const TileFn fn = choose_tile();
  return fn;
}

// One work item: rows [m0, m1) x panels [p0, p1), all of K.
void run_item(void* ctx, int64_t item) {
  const auto& j = *static_cast<const GemmJob*>(ctx);
  const TileFn tile = tile_fn();
  const int64_t m0 = (item / j.n_items) * kMC;
  const int64_t m1 = m0 + kMC < j.M ? m0 + kMC : j.M;
  const int64_t p0 = (item % j.n_items) * j.panels_per_item;
  const int64_t p1 = p0 + j.panels_per_item < j.panels ? p0 + j.panels_per_item : j.panels;
  const int64_t ldc = (p1 - p0) * kNR;
  // Per thread: the float32 output tile (~72 KiB).
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < kMC * ldc) scratch.resize(kMC * ldc);
  float* c = scratch.data();
  for (int64_t k0 = 0; k0 < j.K; k0 += kKC) {
    const int kc = static_cast<int>(j.K - k0 < kKC ? j.K - k0 : kKC);
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* wp = j.w + (p * j.K + k0) * kNR;
      for (int64_t m = m0; m < m1; m += kMR) {
        const int mr = static_cast<int>(m1 - m < kMR ? m1 - m : kMR);
        tile(j.x + m * j.K + k0, j.K, wp, kc, c + (m - m0) * ldc + (p - p0) * kNR, ldc, mr,
             k0 == 0);
      }
    }
  }
  const int64_t n0 = p0 * kNR;
  const int64_t n1 = p1 * kNR < j.N ? p1 * kNR : j.N;
  for (int64_t m = m0; m < m1; ++m) {
    const float* crow = c + (m - m0) * ldc;
    uint16_t* orow = j.out + m * j.out_stride;
    for (int64_t n = n0; n < n1; ++n) {
      float v = crow[n - n0];
      if (j.bias != nullptr) v += bf16_to_f32(j.bias[n]);
      orow[n] = f32_to_bf16(v);
    }
  }
}

struct WidenJob {
  const uint16_t* x;
  int64_t x_stride, K;
  float* dst;
};

void widen_row(void* ctx, int64_t m) {
  const auto& j = *static_cast<const WidenJob*>(ctx);
  const uint16_t* src = j.x + m * j.x_stride;
  float* dst = j.dst + m * j.K;
  for (int64_t k = 0; k < j.K; ++k) dst[k] = bf16_to_f32(src[k]);
}

// Rows of x widened per chunk: at most this many floats (16 MiB) of scratch,
// however long the prefill, and at least one row block.
constexpr int64_t kChunkFloats = 1 << 22;

void bf16_linear(uintptr_t x, int64_t x_stride, int64_t rows, uintptr_t panels, uintptr_t bias,
                 uintptr_t out, int64_t out_stride, int64_t in_features, int64_t out_features,
                 int num_threads) {
  if (rows < 0 || in_features <= 0 || out_features <= 0) {
    throw std::invalid_argument("bf16_linear: rows >= 0, in_features > 0, out_features > 0");
  }
  if (x_stride < in_features || out_stride < out_features) {
    throw std::invalid_argument("bf16_linear: a row stride is shorter than its row");
  }
  if (rows == 0) return;
  if (x == 0 || panels == 0 || out == 0) throw std::invalid_argument("bf16_linear: null buffer");
  GemmJob job{};
  job.K = in_features;
  job.N = out_features;
  job.panels = (out_features + kNR - 1) / kNR;
  job.w = reinterpret_cast<const uint16_t*>(panels);
  job.bias = reinterpret_cast<const uint16_t*>(bias);
  job.out_stride = out_stride;
  const int threads = num_threads > 1 ? num_threads : 1;
  int64_t chunk = kChunkFloats / in_features / kMC * kMC;
  if (chunk < kMC) chunk = kMC;
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  auto* ob = reinterpret_cast<uint16_t*>(out);
  py::gil_scoped_release release;
  // x widened once per chunk, rows in parallel: the tiles broadcast float32 scalars.
  thread_local std::vector<float> xf;
  const int64_t first = rows < chunk ? rows : chunk;
  if (static_cast<int64_t>(xf.size()) < first * in_features) xf.resize(first * in_features);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
    WidenJob widen{xb + r0 * x_stride, x_stride, in_features, xf.data()};
    parallel_for(n, n * in_features >= (1 << 15) ? threads : 1, widen_row, &widen);
    job.x = xf.data();
    job.M = n;
    job.out = ob + r0 * out_stride;
    // About four items per thread, row blocks counted, so uneven finishing evens
    // out; never over 16 panels per item (256 features: a 72 KiB float32 tile).
    const int64_t m_items = (n + kMC - 1) / kMC;
    const int64_t target = 4LL * threads;
    int64_t per = (job.panels * m_items + target - 1) / target;
    job.panels_per_item = per < 1 ? 1 : (per > 16 ? 16 : per);
    job.n_items = (job.panels + job.panels_per_item - 1) / job.panels_per_item;
    parallel_for(m_items * job.n_items, threads, run_item, &job);
  }
}

}  // namespace

const char* bf16_linear_isa() { return tile_fn() == tile_portable ? "portable" : "avx2"; }

void bind_bf16_gemm(py::module_& m) {
  m.def("bf16_linear", &bf16_linear, py::arg("x"), py::arg("x_stride"), py::arg("rows"),
        py::arg("panels"), py::arg("bias"), py::arg("out"), py::arg("out_stride"),
        py::arg("in_features"), py::arg("out_features"), py::arg("num_threads"),
        "out[rows, out_features] = x W^T (+ bias), bfloat16 in and out, float32 FMA inside; "
        "W in 16-feature panels [ceil(N/16)][K][16] (bias 0: none); out must not overlap x.");
}

}  // namespace enginecore
