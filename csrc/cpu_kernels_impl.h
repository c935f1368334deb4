// The CPU model kernels' bodies. cpu_kernels.cpp includes this file once per
// instruction set, inside a namespace named for it and under a matching
// `#pragma GCC target`, so the compiler vectorizes the same loops for
// AVX-512, AVX2 and the baseline; the dispatcher picks one by CPUID.
// No includes here: cpu_kernels.cpp provides them (and cpu_kernels.h's types).
//
// Numerics: inputs bf16 or fp32. Every kernel rounds to the model dtype exactly
// where its torch twin does. What an order or an exp could move (a sum, a
// softmax, SiLU's exp) is computed in float64 on both sides, so the two agree to
// ~1e-16 before the rounding and give the same bits: native and twin tokens are
// identical in bf16 too (tests/test_default_model_twin_tokens.py). RoPE is
// float32 products rounded as torch rounds them.

#define ECK_INLINE inline __attribute__((always_inline))

// -- dtype access ----------------------------------------------------------------------
ECK_INLINE float to_f32(float x) { return x; }
ECK_INLINE float to_f32(bf16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16);
}
ECK_INLINE void from_f32(float x, float* dst) { *dst = x; }
// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN.
ECK_INLINE void from_f32(float x, bf16* dst) {
  uint32_t u = __builtin_bit_cast(uint32_t, x);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  dst->bits = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}
// x rounded to the model dtype and back: where the torch twin stores an
// intermediate tensor in that dtype.
ECK_INLINE float round_to(float x, const float*) { return x; }
ECK_INLINE float round_to(float x, const bf16*) {
  bf16 b;
  from_f32(x, &b);
  return to_f32(b);
}

// (e^r - 1) / r = 1 + r/2! + ... + r^12/13! for |r| <= ln2 / 2: exp_f64's polynomial
// without its constant term, so that expm1 of a small argument keeps its digits.
ECK_INLINE double exp_taylor_tail(double r) {
  double p = 1.6059043836821613e-10;  // 1/13!
  p = p * r + 2.08767569878681e-09;   // 1/12!
  p = p * r + 2.505210838544172e-08;  // 1/11!
  p = p * r + 2.755731922398589e-07;  // 1/10!
  p = p * r + 2.7557319223985893e-06;
  p = p * r + 2.48015873015873e-05;
  p = p * r + 1.984126984126984e-04;
  p = p * r + 1.388888888888889e-03;
  p = p * r + 8.333333333333333e-03;
  p = p * r + 4.1666666666666664e-02;
  p = p * r + 1.6666666666666666e-01;
  p = p * r + 0.5;
  return p * r + 1.0;
}

// exp in float64: Cody-Waite split x = n ln2 + r (|r| <= ln2 / 2), a degree-13
// Taylor polynomial for exp(r) (remainder under 2^-57), then 2^n by the exponent
// bits: within a few double ulp of exp, written so the compiler vectorizes it.
// The kernels whose torch twins compute in float64 (RMSNorm's sum, SiLU, the
// attention's softmax) use it, so both sides agree to ~1e-16 before their one
// rounding to float32 / bf16 at the end and land on the same bits (a float32
// tie inside that distance is ~1e-8 likely per value; a bf16 one far rarer).
// Below -708 (where doubles go subnormal) it gives 0, above 709 +inf: nothing
// that survives the rounding to float32 lives out there (softmax exponents are
// <= 0, and SiLU's x / (1 + e^-x) there is a float32 zero or x itself).
// NaN stays NaN.
ECK_INLINE double exp_f64(double x) {
  const double xc = x < -708.0 ? -708.0 : (x > 709.0 ? 709.0 : x);
  // n = round(x / ln 2) by the 1.5 * 2^52 shift; its low bits are n itself.
  const double shifted = xc * 1.4426950408889634 + 6755399441055744.0;
  const double n = shifted - 6755399441055744.0;
  double r = xc - n * 6.93147180369123816490e-01;  // ln2's high part: n * it is exact
  r = r - n * 1.90821492927058770002e-10;           // and its low part
  const double p = exp_taylor_tail(r) * r + 1.0;
  const int64_t e = (__builtin_bit_cast(int64_t, shifted) - 0x4338000000000000LL) + 1023;
  const double y = p * __builtin_bit_cast(double, e << 52);
  return x < -708.0 ? 0.0 : (x > 709.0 ? __builtin_inf() : y);
}

// tanh in float64 from exp_f64 (odd; a = |x|): 1 - 2 / (e^2a + 1), capped where it
// is 1 in double; below a = 0.17 (2a inside exp's reduced range) e^2a - 1 from the
// polynomial's tail, over itself plus 2: the subtraction from 1 would cancel the
// leading digits of a small tanh (a soft cap far above the scores: ~1e-11 apart
// from torch's tanh at a cap of 1e5, a few double ulp now).
ECK_INLINE double tanh_f64(double x) {
  const double a = x < 0 ? -x : x;
  const bool small = a < 0.17;
  const double s = small ? 2.0 * a : 0.0;  // both sides computed: the loop vectorizes
  const double em1 = exp_taylor_tail(s) * s;
  const double t_small = em1 / (em1 + 2.0);
  const double t_big = 1.0 - 2.0 / (exp_f64(2.0 * (a > 20.0 ? 20.0 : a)) + 1.0);
  const double t = small ? t_small : t_big;
  return x < 0 ? -t : t;
}

// -- paged attention -------------------------------------------------------------------
// Where one work item sits: its sequence's first query token in q / out (qstart),
// the position of that sequence's first query token (first_pos), and the positions
// [lo, hi] its rows may see (hi: its last token's; lo: 0, or the window's start).
struct ItemSpan {
  int qstart, first_pos, lo, hi;
};
ECK_INLINE ItemSpan item_span(const AttnParams& p, const AttnItem& it) {
  const int qstart = p.query_start[it.seq];
  const int first_pos = p.seq_lens[it.seq] - (p.query_start[it.seq + 1] - qstart);
  int lo = 0;
  if (p.sliding_window > 0) {
    lo = first_pos + it.q0 - p.sliding_window + 1;
    if (lo < 0) lo = 0;
  }
  return {qstart, first_pos, lo, first_pos + it.q1 - 1};
}

// Row r's result (rows: each query token's G heads of the item's KV head): the
// weighted sum acc times 1 / l, rounded once to float32 and the model dtype, into
// its token's head. l = 0 (nothing visible) gives 0 * inf = NaN, as torch's softmax.
template <typename T>
ECK_INLINE void write_row(const AttnParams& p, const AttnItem& it, int qstart, int r, int G,
                          int D, const double* acc, double l) {
  const int i = it.q0 + r / G;
  const int h = it.kvh * G + r % G;
  T* dst = static_cast<T*>(p.out) + static_cast<int64_t>(qstart + i) * p.out_st +
           static_cast<int64_t>(h) * p.out_sh;
  const double inv = 1.0 / l;
#pragma omp simd
  for (int d = 0; d < D; ++d) from_f32(static_cast<float>(acc[d] * inv), dst + d);
}

// One row's scores of one tile (positions t0 .. t0 + n - 1; the row's own position
// qp): soft cap, causal / window mask, then the online softmax: the scores become
// weights against the running max m (updated with the running sum l). Returns the
// factor what the row accumulated before must be scaled by (1 when the max stayed,
// and when nothing in the tile is visible: weights 0, m and l untouched). As torch's
// softmax: a visible NaN score makes the row NaN (l = NaN: a tile of nothing but NaN
// would otherwise pass for an empty one), and a row with nothing visible (l = 0 at
// the end) comes out NaN.
ECK_INLINE double softmax_tile_row(const AttnParams& p, double* sr, int n, int t0, int qp,
                                   double& m, double& l) {
  if (p.soft_cap > 0.0) {
    const double cap = p.soft_cap, inv = 1.0 / p.soft_cap;
#pragma omp simd
    for (int j = 0; j < n; ++j) sr[j] = cap * tanh_f64(sr[j] * inv);
  }
  const int win = p.sliding_window;
  // Mask only tiles that reach past the row's position or out of its window
  // (a decode row never does: its position is the last one).
  if (t0 + n - 1 > qp || (win > 0 && qp - t0 >= win)) {
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      const bool ok = t <= qp && (win <= 0 || qp - t < win);
      sr[j] = ok ? sr[j] : -__builtin_inf();
    }
  }
  double mt = -__builtin_inf();
#pragma omp simd reduction(max : mt)
  for (int j = 0; j < n; ++j) mt = sr[j] > mt ? sr[j] : mt;
  if (mt == -__builtin_inf()) {  // nothing visible in this tile: weights 0
    bool nan = false;
    for (int j = 0; j < n; ++j) {
      nan |= sr[j] != sr[j];
      sr[j] = 0.0;
    }
    if (nan) l = __builtin_nan("");
    return 1.0;
  }
  const double m_new = mt > m ? mt : m;
  const double corr = exp_f64(m - m_new);
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    sr[j] = exp_f64(sr[j] - m_new);
    sum += sr[j];
  }
  l = l * corr + sum;
  m = m_new;
  return corr;
}

// One work item: the query tokens [q0, q1) of sequence `seq` (rows: each token's
// G query heads of KV head `kvh`) against that sequence's cached context, read
// in place through its block table; online softmax over tiles of positions.
// In float64 throughout (bf16 and float32 values widen exactly), rounded once
// at the end: the torch twin computes the same in float64, so the two agree to
// ~1e-16 before that rounding and give the same bits (module comment above).
template <typename T, int DC>
void attend_item(const AttnParams& p, const AttnItem& it, double* buf) {
  const int D = DC > 0 ? DC : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int nq = it.q1 - it.q0;
  const int R = G * nq;
  double* Q = buf;                   // [R][D] scaled queries
  double* acc = Q + R * D;           // [R][D]
  double* S = acc + R * D;           // [R][kTile] scores, then probabilities
  double* m = S + R * kTile;         // [R] running max
  double* l = m + R;                 // [R] running sum
  double* kf = l + R;                // [kTile][D] the tile's K (or V)
  int* qpos = reinterpret_cast<int*>(kf + kTile * D);  // [R]

  const T* q = static_cast<const T*>(p.q);
  const auto [qstart, first_pos, lo, hi] = item_span(p, it);
  for (int r = 0; r < R; ++r) {
    const int i = it.q0 + r / G;
    const int h = it.kvh * G + r % G;
    const T* src = q + static_cast<int64_t>(qstart + i) * p.q_st + static_cast<int64_t>(h) * p.q_sh;
    double* dst = Q + r * D;
#pragma omp simd
    for (int d = 0; d < D; ++d) dst[d] = static_cast<double>(to_f32(src[d])) * p.scale;
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[r * D + d] = 0.0;
    m[r] = -__builtin_inf();
    l[r] = 0.0;
    qpos[r] = first_pos + i;
  }
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* table = p.block_table + static_cast<int64_t>(it.seq) * p.bt_stride;
  const int bs = p.block_size;
  const int64_t head_off = static_cast<int64_t>(it.kvh) * p.c_sh;
  int64_t slots[kTile];
  for (int t0 = lo; t0 <= hi; t0 += kTile) {
    const int n = hi - t0 + 1 < kTile ? hi - t0 + 1 : kTile;
    for (int j = 0; j < n; ++j) {  // a tile may span blocks: each position's slot
      const int t = t0 + j;
      slots[j] = static_cast<int64_t>(table[t / bs]) * bs + t % bs;
    }
    if (R >= kTransposedMinRows) {
      // Many rows (prefill): the tile's K transposed to [D][kTile] (zero past n),
      // so a row's scores are kTile-wide vector multiply-adds with no horizontal
      // sums; the transpose is paid once for all rows.
      for (int j = 0; j < n; ++j) {
        const T* kp = kc + slots[j] * p.c_ss + head_off;
        for (int d = 0; d < D; ++d) kf[d * kTile + j] = to_f32(kp[d]);
      }
      if (n < kTile) {
        for (int d = 0; d < D; ++d) {
          for (int j = n; j < kTile; ++j) kf[d * kTile + j] = 0.0;
        }
      }
      for (int r = 0; r < R; ++r) {
        const double* qr = Q + r * D;
        double sc[kTile];
#pragma omp simd
        for (int j = 0; j < kTile; ++j) sc[j] = 0.0;
        for (int d = 0; d < D; ++d) {
          const double qd = qr[d];
          const double* kd = kf + d * kTile;
#pragma omp simd
          for (int j = 0; j < kTile; ++j) sc[j] += qd * kd[j];
        }
        double* sr = S + r * kTile;
#pragma omp simd
        for (int j = 0; j < kTile; ++j) sr[j] = sc[j];
      }
    } else {
      // Few rows (decode: the G heads of one KV head): each K row widened
      // once and dotted with every row; a transpose would cost more than it saves.
      for (int j = 0; j < n; ++j) {
        const T* kp = kc + slots[j] * p.c_ss + head_off;
        double* kr = kf + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) kr[d] = to_f32(kp[d]);
      }
      for (int r = 0; r < R; ++r) {
        const double* qr = Q + r * D;
        for (int j = 0; j < n; ++j) {
          const double* kr = kf + j * D;
          double sc = 0.0;
#pragma omp simd reduction(+ : sc)
          for (int d = 0; d < D; ++d) sc += qr[d] * kr[d];
          S[r * kTile + j] = sc;
        }
      }
    }
    // Soft cap, masks, online softmax: per row, rescale what was accumulated
    // when the max grows, then turn the tile's scores into weights.
    for (int r = 0; r < R; ++r) {
      const double corr = softmax_tile_row(p, S + r * kTile, n, t0, qpos[r], m[r], l[r]);
      if (corr != 1.0) {
        // A factor of 0 (the max jumped past exp_f64's range) drops what came before,
        // as the twin's weights of 0 there do, even an inf V it had added.
        double* ar = acc + r * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ar[d] = corr == 0.0 ? 0.0 : ar[d] * corr;
      }
    }
    // Values: each V row widened once (into the K tile's buffer, now free),
    // added into every row that sees it.
    for (int j = 0; j < n; ++j) {
      const T* vp = vc + slots[j] * p.c_ss + head_off;
      double* vr = kf + j * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) vr[d] = to_f32(vp[d]);
    }
    for (int r = 0; r < R; ++r) {
      double* ar = acc + r * D;
      const double* sr = S + r * kTile;
      for (int j = 0; j < n; ++j) {
        const double w = sr[j];
        // A weight of 0 (masked, or an exp below double's range) adds nothing,
        // even times a NaN or inf V row the position never saw.
        if (w == 0.0) continue;
        const double* vr = kf + j * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ar[d] += w * vr[d];
      }
    }
  }
  for (int r = 0; r < R; ++r) write_row<T>(p, it, qstart, r, G, D, acc + r * D, l[r]);
}

#ifdef ECK_AVX512_DECODE
#include "attention_decode_avx512.h"
#endif

template <typename T>
void attend(const AttnParams& p, const AttnItem& it, double* buf) {
#ifdef ECK_AVX512_DECODE
  // Few rows (decode): on registers where the head size has a path there.
  if (p.head_dim == 64 && attend_decode_fast<T, 64>(p, it)) return;
  if (p.head_dim == 128 && attend_decode_fast<T, 128>(p, it)) return;
#endif
  switch (p.head_dim) {
    case 64: return attend_item<T, 64>(p, it, buf);
    case 128: return attend_item<T, 128>(p, it, buf);
    default: return attend_item<T, 0>(p, it, buf);
  }
}

void attend_items(const AttnParams& p, const AttnItem& it, double* buf) {
  if (p.dtype == DType::kBFloat16) {
    attend<bf16>(p, it, buf);
  } else {
    attend<float>(p, it, buf);
  }
}

// -- RMSNorm (+ residual add) ----------------------------------------------------------
// Rows [r0, r1): with a residual, h = round(h + delta) is written back into
// `residual` first (torch: `h = h + delta`); then out = w * round(h / sqrt(mean(h^2) + eps))
// with the mean of squares and the scaling in float64 (exact squares, a sum whose
// order moves it by ~1e-16: the twin's float64 lands on the same float32), then
// rounded to float32 and the model dtype, the scale by w in the model dtype
// (transformers' LlamaRMSNorm, its float32 math done in float64).
template <typename T>
void rms_norm_rows(const RmsNormParams& p, int64_t r0, int64_t r1) {
  const int n = p.hidden;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t row = r0; row < r1; ++row) {
    T* h = static_cast<T*>(p.x) + row * p.x_stride;
    const T* delta = p.delta ? static_cast<const T*>(p.delta) + row * p.delta_stride : nullptr;
    T* out = static_cast<T*>(p.out) + row * p.out_stride;
    double ss = 0.0;
    if (delta != nullptr) {
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < n; ++i) {
        const float v = round_to(to_f32(h[i]) + to_f32(delta[i]), h);
        from_f32(v, h + i);
        ss += static_cast<double>(v) * v;
      }
    } else {
#pragma omp simd reduction(+ : ss)
      for (int i = 0; i < n; ++i) {
        const double v = to_f32(h[i]);
        ss += v * v;
      }
    }
    const double inv = 1.0 / __builtin_sqrt(ss / n + p.eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) {
      const float normed = round_to(static_cast<float>(to_f32(h[i]) * inv), h);
      from_f32(to_f32(w[i]) * normed, out + i);
    }
  }
}

void rms_norm(const RmsNormParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    rms_norm_rows<bf16>(p, r0, r1);
  } else {
    rms_norm_rows<float>(p, r0, r1);
  }
}

// -- RoPE (rotate-half / NeoX layout), in place ------------------------------------------
// Per token and head: x1, x2 = halves of the first rotary_dim values;
// x1' = round(round(x1 c) + round(-x2 s)), x2' = round(round(x2 c) + round(x1 s)),
// with c, s from the model-dtype tables, as `x * cos + rotate_half(x) * sin` in torch.
// No fused multiply-add here: torch rounds each product before the sum, and so
// must we for the twin's (and transformers') bits in float32.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_rows(const RopeParams& p, int64_t r0,
                                                             int64_t r1) {
  const int half = p.rotary_dim / 2;
  const T* cos_t = static_cast<const T*>(p.cos);
  const T* sin_t = static_cast<const T*>(p.sin);
  for (int64_t tok = r0; tok < r1; ++tok) {
    const int64_t pos = p.positions[tok];
    const T* c = cos_t + pos * p.table_stride;
    const T* s = sin_t + pos * p.table_stride;
    for (int h = 0; h < p.num_heads; ++h) {
      T* x = static_cast<T*>(p.x) + tok * p.x_st + static_cast<int64_t>(h) * p.x_sh;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
        const float c1 = to_f32(c[i]), s1 = to_f32(s[i]);
        const float c2 = to_f32(c[i + half]), s2 = to_f32(s[i + half]);
        const float y1 = round_to(x1 * c1, x) + round_to(-x2 * s1, x);
        const float y2 = round_to(x2 * c2, x) + round_to(x1 * s2, x);
        from_f32(y1, x + i);
        from_f32(y2, x + i + half);
      }
    }
  }
}

void rope(const RopeParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    rope_rows<bf16>(p, r0, r1);
  } else {
    rope_rows<float>(p, r0, r1);
  }
}

// -- SiLU(gate) * up ---------------------------------------------------------------------
// gate | up side by side in each input row: out = round(round(silu(g)) * u),
// as `F.silu(gate) * up` in the model dtype, silu(g) = g / (1 + e^-g) in float64
// (the twin's too), rounded to float32 and then the model dtype.
// Two loops over chunks of a row (silu into a float buffer, then the product):
// one loop with the bf16 loads made GCC take 16 lanes per AVX2 iteration and
// spill the exp's constants (1.65x slower).
template <typename T>
void silu_and_mul_rows(const SiluMulParams& p, int64_t r0, int64_t r1) {
  constexpr int kChunk = 256;
  alignas(64) float act[kChunk];
  const int n = p.width;
  for (int64_t row = r0; row < r1; ++row) {
    const T* g = static_cast<const T*>(p.x) + row * p.x_stride;
    const T* u = g + n;
    T* out = static_cast<T*>(p.out) + row * p.out_stride;
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int m = n - c0 < kChunk ? n - c0 : kChunk;
#pragma omp simd
      for (int i = 0; i < m; ++i) {
        const double gv = to_f32(g[c0 + i]);
        act[i] = static_cast<float>(gv / (1.0 + exp_f64(-gv)));
      }
#pragma omp simd
      for (int i = 0; i < m; ++i) {
        from_f32(round_to(act[i], out) * to_f32(u[c0 + i]), out + c0 + i);
      }
    }
  }
}

void silu_and_mul(const SiluMulParams& p, int64_t r0, int64_t r1) {
  if (p.dtype == DType::kBFloat16) {
    silu_and_mul_rows<bf16>(p, r0, r1);
  } else {
    silu_and_mul_rows<float>(p, r0, r1);
  }
}

#undef ECK_INLINE
