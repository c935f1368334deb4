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
// Blocking as a BLIS-style GEMM: a 3 x 16 register tile of doubles (12
// accumulators), K in blocks of 128 (the panel block, widened to doubles once,
// 16 KiB, stays in L1 across the row tiles), rows in blocks of 72 (the widened x
// block stays in L2 across panels; x is widened once, in chunks of at most 16 MiB).
//
// Numerics: bf16 x bf16 products are exact in double, every output is a float64
// sum of them (carried through a double scratch between K blocks), rounded to
// float32, plus the bias in float32, rounded to bf16 (nearest even). The torch
// twin (model/linear.py bf16_linear_torch) is a float64 matmul, rounded the same
// way: the sums' orders differ by ~1e-16, so the outputs are the same bits (a
// float32 tie within that is ~1e-7 likely per output, a bf16 one ~1e-12), and a
// model's tokens are the same native or not. A float32 sum (the first version)
// was twice as fast per FMA but no twin can follow its order at a usable speed.
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
constexpr int kMR = 3;    // rows per register tile
constexpr int kKC = 128;  // k per block
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
  const double* x;  // [M, K]: this chunk's rows of x, widened
  int64_t M, K, N, panels;
  const uint16_t* w;     // [panels][K][16]
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* out;
  int64_t out_stride;
  int64_t panels_per_item, n_items;
};

// c[r][0..16) (+)= sum over k of a[r][k] * w[k][0..16), rows r < mr; w is the
// panel block widened to doubles.
using TileFn = void (*)(const double* a, int64_t lda, const double* w, int kc, double* c,
                        int64_t ldc, int mr, bool first);

void tile_portable(const double* a, int64_t lda, const double* w, int kc, double* c,
                   int64_t ldc, int mr, bool first) {
  for (int r = 0; r < mr; ++r) {
    double acc[kNR];
    for (int j = 0; j < kNR; ++j) acc[j] = first ? 0.0 : c[r * ldc + j];
    for (int k = 0; k < kc; ++k) {
      const double av = a[r * lda + k];
      for (int j = 0; j < kNR; ++j) acc[j] += av * w[k * kNR + j];
    }
    for (int j = 0; j < kNR; ++j) c[r * ldc + j] = acc[j];
  }
}

// The same for 1-2 rows straight from the bf16 panel, all of K (a decode step of up to
// kDirectRows rows calls it per pair of rows): each weight is used a few times, so
// widening a block to doubles first cost more than the FMAs (3.4x the float32
// kernel at one row, cache-resident); here it is widened in registers.
using DirectFn = void (*)(const double* a, int64_t lda, const uint16_t* w, int64_t k,
                          double* c, int64_t ldc, int mr);

void direct_portable(const double* a, int64_t lda, const uint16_t* w, int64_t K, double* c,
                     int64_t ldc, int mr) {
  for (int r = 0; r < mr; ++r) {
    double acc[kNR] = {};
    for (int64_t k = 0; k < K; ++k) {
      const double av = a[r * lda + k];
      for (int j = 0; j < kNR; ++j) acc[j] += av * bf16_to_f32(w[k * kNR + j]);
    }
    for (int j = 0; j < kNR; ++j) c[r * ldc + j] = acc[j];
  }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ENGINECORE_AVX2_GEMM 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")

template <int MR>
inline __attribute__((always_inline)) void tile_avx2_rows(const double* a, int64_t lda,
                                                          const double* w, int kc, double* c,
                                                          int64_t ldc, bool first) {
  __m256d acc[MR][4];
#pragma GCC unroll 3
  for (int r = 0; r < MR; ++r) {
    for (int i = 0; i < 4; ++i) {
      acc[r][i] = first ? _mm256_setzero_pd() : _mm256_loadu_pd(c + r * ldc + 4 * i);
    }
  }
  for (int k = 0; k < kc; ++k) {
    const double* wk = w + k * kNR;
#pragma GCC unroll 3
    for (int r = 0; r < MR; ++r) {
      const __m256d av = _mm256_broadcast_sd(a + r * lda + k);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_pd(av, _mm256_load_pd(wk + 4 * i), acc[r][i]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < MR; ++r) {
    for (int i = 0; i < 4; ++i) _mm256_storeu_pd(c + r * ldc + 4 * i, acc[r][i]);
  }
}

template <int MR>
inline __attribute__((always_inline)) void direct_avx2_rows(const double* a, int64_t lda,
                                                            const uint16_t* w, int64_t K,
                                                            double* c, int64_t ldc) {
  __m256d acc[MR][4];
  for (int r = 0; r < MR; ++r) {
    for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_setzero_pd();
  }
  for (int64_t k = 0; k < K; ++k) {
    // 16 bf16 -> 16 floats (two 8-wide halves) -> four vectors of 4 doubles.
    __m256d b[4];
    for (int h = 0; h < 2; ++h) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kNR + 8 * h));
      const __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
      b[2 * h] = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
      b[2 * h + 1] = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    }
    for (int r = 0; r < MR; ++r) {
      const __m256d av = _mm256_broadcast_sd(a + r * lda + k);
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm256_fmadd_pd(av, b[i], acc[r][i]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int i = 0; i < 4; ++i) _mm256_storeu_pd(c + r * ldc + 4 * i, acc[r][i]);
  }
}

void direct_avx2(const double* a, int64_t lda, const uint16_t* w, int64_t K, double* c,
                 int64_t ldc, int mr) {
  if (mr == 2) return direct_avx2_rows<2>(a, lda, w, K, c, ldc);
  return direct_avx2_rows<1>(a, lda, w, K, c, ldc);
}

void tile_avx2(const double* a, int64_t lda, const double* w, int kc, double* c, int64_t ldc,
               int mr, bool first) {
  switch (mr) {
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

const DirectFn& direct_fn() {
#ifdef ENGINECORE_AVX2_GEMM
  static const DirectFn fn = tile_fn() == tile_portable ? direct_portable : direct_avx2;
#else
  static const DirectFn fn = direct_portable;
#endif
  return fn;
}

// Rows up to which a call takes direct_fn (with the weights streaming from memory:
// 1 row 9 ms vs 12.5 for the float32 kernel over the default model's 30 layers,
// 4 rows 27 ms vs 31 through the widened blocks; docs/benchmarks.md).
constexpr int64_t kDirectRows = 4;

// One work item: rows [m0, m1) x panels [p0, p1), all of K.
void run_item(void* ctx, int64_t item) {
  const auto& j = *static_cast<const GemmJob*>(ctx);
  const TileFn tile = tile_fn();
  const int64_t m0 = (item / j.n_items) * kMC;
  const int64_t m1 = m0 + kMC < j.M ? m0 + kMC : j.M;
  const int64_t p0 = (item % j.n_items) * j.panels_per_item;
  const int64_t p1 = p0 + j.panels_per_item < j.panels ? p0 + j.panels_per_item : j.panels;
  const int64_t ldc = (p1 - p0) * kNR;
  // Per thread: the double output tile (~144 KiB) and one widened panel block.
  thread_local std::vector<double> scratch;
  if (static_cast<int64_t>(scratch.size()) < kMC * ldc) scratch.resize(kMC * ldc);
  alignas(32) thread_local double wblock[kKC * kNR];
  double* c = scratch.data();
  if (j.M <= kDirectRows) {
    const DirectFn direct = direct_fn();
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t m = m0; m < m1; m += 2) {
        direct(j.x + m * j.K, j.K, j.w + p * j.K * kNR, j.K, c + (m - m0) * ldc + (p - p0) * kNR,
               ldc, static_cast<int>(m1 - m < 2 ? m1 - m : 2));
      }
    }
  }
  for (int64_t k0 = 0; j.M > kDirectRows && k0 < j.K; k0 += kKC) {
    const int kc = static_cast<int>(j.K - k0 < kKC ? j.K - k0 : kKC);
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* wp = j.w + (p * j.K + k0) * kNR;
      for (int i = 0; i < kc * kNR; ++i) wblock[i] = bf16_to_f32(wp[i]);
      for (int64_t m = m0; m < m1; m += kMR) {
        const int mr = static_cast<int>(m1 - m < kMR ? m1 - m : kMR);
        tile(j.x + m * j.K + k0, j.K, wblock, kc, c + (m - m0) * ldc + (p - p0) * kNR, ldc, mr,
             k0 == 0);
      }
    }
  }
  const int64_t n0 = p0 * kNR;
  const int64_t n1 = p1 * kNR < j.N ? p1 * kNR : j.N;
  for (int64_t m = m0; m < m1; ++m) {
    const double* crow = c + (m - m0) * ldc;
    uint16_t* orow = j.out + m * j.out_stride;
    for (int64_t n = n0; n < n1; ++n) {
      float v = static_cast<float>(crow[n - n0]);
      if (j.bias != nullptr) v += bf16_to_f32(j.bias[n]);
      orow[n] = f32_to_bf16(v);
    }
  }
}

struct WidenJob {
  const uint16_t* x;
  int64_t x_stride, K;
  double* dst;
};

void widen_row(void* ctx, int64_t m) {
  const auto& j = *static_cast<const WidenJob*>(ctx);
  const uint16_t* src = j.x + m * j.x_stride;
  double* dst = j.dst + m * j.K;
  for (int64_t k = 0; k < j.K; ++k) dst[k] = bf16_to_f32(src[k]);
}

// Rows of x widened per chunk: at most this many doubles (16 MiB) of scratch,
// however long the prefill, and at least one row block.
constexpr int64_t kChunkDoubles = 1 << 21;

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
  int64_t chunk = kChunkDoubles / in_features / kMC * kMC;
  if (chunk < kMC) chunk = kMC;
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  auto* ob = reinterpret_cast<uint16_t*>(out);
  py::gil_scoped_release release;
  // x widened once per chunk, rows in parallel: the tiles broadcast its doubles.
  thread_local std::vector<double> xf;
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
    // out; never over 16 panels per item (256 features: a 144 KiB double tile).
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
        "out[rows, out_features] = x W^T (+ bias), bfloat16 in and out, float64 sums inside; "
        "W in 16-feature panels [ceil(N/16)][K][16] (bias 0: none); out must not overlap x.");
}

}  // namespace enginecore
